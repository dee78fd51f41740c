"""Activation-aware weight quantization (AWQ-style) scale search.

Input channels that carry large activations matter most. For every linear layer we record
the mean |x| per input channel on a small calibration set, then search one exponent alpha:
s = mean|x| ** alpha (normalised), quantize W * s, and run the layer as (x / s) @ Q(W s)^T.
The alpha with the smallest output error on recorded calibration rows wins; alpha = 0 is
plain round-to-nearest, so the search never does worse than RTN on the calibration rows.
Because our layers are callables, 1/s is applied to x inside the layer (one elementwise
multiply per call) instead of being folded into the previous norm.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hasten.model.linear import DenseLinear, LinearLayer

logger = logging.getLogger(__name__)

ALPHA_GRID = tuple(i / 20 for i in range(20))  # 0.0 .. 0.95
MAX_EVAL_OUTPUTS = 4096  # output channels sampled to score a candidate (lm_head has 49k)


@dataclass
class ActivationStats:
    abs_sum: torch.Tensor  # float32 [K]: sum over rows of |x|
    rows: int = 0
    samples: list[torch.Tensor] = field(default_factory=list)  # float32 [r, K] pieces

    @property
    def abs_mean(self) -> torch.Tensor:
        return self.abs_sum / max(self.rows, 1)

    def sample_matrix(self) -> torch.Tensor:
        return torch.cat(self.samples) if self.samples else torch.zeros(0, self.abs_sum.numel())


class _Recorder:
    """A LinearFactory whose layers run dense and record their inputs."""

    def __init__(self, rows_per_call: int, seed: int = 0):
        self.stats: dict[str, ActivationStats] = {}
        self.rows_per_call = rows_per_call
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearLayer:
        dense = DenseLinear(weight, bias)
        stats = self.stats.setdefault(name, ActivationStats(torch.zeros(weight.shape[1])))

        def layer(x: torch.Tensor) -> torch.Tensor:
            xf = x.float()
            stats.abs_sum += xf.abs().sum(0)
            stats.rows += xf.shape[0]
            pick = torch.randperm(xf.shape[0], generator=self.gen)[: self.rows_per_call]
            stats.samples.append(xf[pick].clone())
            return dense(x)

        return layer


def collect_activation_stats(folder: Path, chunks: list[list[int]], max_samples: int = 512) -> dict[str, ActivationStats]:
    """Run the float32 model over calibration `chunks`, recording every linear layer's inputs."""
    from hasten.model.config import ModelConfig
    from hasten.model.decoder import Decoder
    from hasten.model.loader import load_hf_config, load_state_dict
    from hasten.quant.evaluate import prefill_hidden

    cfg = ModelConfig.from_hf(load_hf_config(folder))
    state = load_state_dict(folder)
    max_len = max(len(c) for c in chunks) + 1
    recorder = _Recorder(rows_per_call=max(1, -(-max_samples // len(chunks))))
    decoder = Decoder(cfg, state, torch.float32, max_len, recorder)
    del state
    with torch.inference_mode():
        for ids in chunks:
            hidden = prefill_hidden(decoder, ids)
            decoder.logits(hidden)  # lm_head sees its inputs too
    return recorder.stats


def search_input_scale(
    weight: torch.Tensor,
    stats: ActivationStats,
    fake_quantize: Callable[[torch.Tensor], torch.Tensor],
    grid: tuple[float, ...] = ALPHA_GRID,
    seed: int = 0,
) -> tuple[torch.Tensor | None, float, dict[float, float]]:
    """Best per-input-channel scale s [K] (None when alpha = 0 wins), its alpha, and every alpha's error."""
    w = weight.float()
    x = stats.sample_matrix()
    if x.shape[0] == 0:
        return None, 0.0, {}
    if w.shape[0] > MAX_EVAL_OUTPUTS:
        gen = torch.Generator().manual_seed(seed)
        w_eval_rows = torch.randperm(w.shape[0], generator=gen)[:MAX_EVAL_OUTPUTS]
    else:
        w_eval_rows = None
    w_eval = w if w_eval_rows is None else w[w_eval_rows]
    ref = x @ w_eval.t()
    mean = stats.abs_mean.clamp(min=1e-5)
    errors: dict[float, float] = {}
    best_alpha, best_err, best_s = 0.0, float("inf"), None
    for alpha in grid:
        s = mean.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        wq = fake_quantize(w_eval * s[None, :]) / s[None, :]
        err = float((x @ wq.t() - ref).pow(2).mean())
        errors[alpha] = err
        if err < best_err:
            best_alpha, best_err, best_s = alpha, err, s
    if best_alpha == 0.0:
        return None, 0.0, errors
    return best_s, best_alpha, errors
