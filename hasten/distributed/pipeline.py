"""Pipeline parallelism: the decoder's layers split into stages, one rank each, micro-batches in flight.

Stage s holds layers [first, last) (the first stages one more when they do not divide evenly), their
part of the KV pool, the embedding (stage 0) and the final norm + lm_head (the last stage). Rank 0 is
stage 0 and runs the scheduler: each step it splits the batch's sequences into up to `stages`
micro-batches, broadcasts their inputs, and every stage runs them in order: receive the residual
stream of micro-batch m from the stage before, run its layers, send it on (asynchronously, so stage
s works on m + 1 while stage s + 1 takes m). The last stage sends the logits rows back to rank 0,
which samples. Over a network that is one hidden-state transfer per stage boundary instead of TP's
two all-reduces per layer.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from hasten.distributed.group import ParallelGroup, TensorParallelError
from hasten.engine.model_runner import ModelRunner, StepInputs, StepResult
from hasten.engine.scheduler import ScheduledBatch
from hasten.model.config import ModelConfig
from hasten.model.decoder import Decoder
from hasten.model.linear import LinearFactory, LinearLayer


@dataclass(frozen=True)
class StagePlan:
    cfg: ModelConfig
    stage: int
    stages: int

    def __post_init__(self) -> None:
        if self.stages < 1 or not 0 <= self.stage < self.stages:
            raise ValueError(f"stage {self.stage} of a pipeline of {self.stages}")
        if self.cfg.num_layers < self.stages:
            raise ValueError(f"--pipeline-parallel-size {self.stages} exceeds the model's {self.cfg.num_layers} layers")

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def layers(self) -> tuple[int, int]:
        base, extra = divmod(self.cfg.num_layers, self.stages)
        lo = self.stage * base + min(self.stage, extra)
        return lo, lo + base + (1 if self.stage < extra else 0)

    def local_config(self) -> ModelConfig:
        lo, hi = self.layers()
        c = self.cfg
        return replace(c, num_layers=hi - lo, layer_windows=c.layer_windows[lo:hi] if c.layer_windows else [],
                       moe_layers=c.moe_layers[lo:hi] if c.moe_layers else [])


_LOCAL_LAYER = re.compile(r"(model\.)?layers\.(\d+)\.(.+)$")


class StageState(Mapping[str, torch.Tensor]):
    """The checkpoint as stage `plan.stage` sees it: its layers renumbered from 0, read lazily; the
    embedding empty except where the stage needs it (stage 0; the last stage when lm_head is tied)."""

    def __init__(self, folder: Path, plan: StagePlan):
        self.plan = plan
        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"pipeline parallelism reads safetensors checkpoints; none in {folder}")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: i for i, h in enumerate(self._handles) for name in h.keys()}
        self.offset, self.end = plan.layers()

    def _global(self, name: str) -> str | None:
        m = _LOCAL_LAYER.fullmatch(name)
        if m is None:
            return name
        j = int(m.group(2))
        if j >= self.end - self.offset:
            return None
        return f"{m.group(1) or ''}layers.{j + self.offset}.{m.group(3)}"

    def __contains__(self, name: object) -> bool:
        g = self._global(name) if isinstance(name, str) else None
        return g is not None and g in self._where

    def __iter__(self) -> Iterator[str]:
        return iter([])  # the decoder asks by name only

    def __len__(self) -> int:
        return 0

    def __getitem__(self, name: str) -> torch.Tensor:
        g = self._global(name)
        if g is None or g not in self._where:
            raise KeyError(name)
        p = self.plan
        needs_embed = p.first or (p.last and p.cfg.tie_word_embeddings)
        if (name == "model.embed_tokens.weight" and not needs_embed) or (name == "lm_head.weight" and not p.last):
            return torch.empty(0, p.cfg.hidden_size)
        return self._handles[self._where[g]].get_tensor(g)


class _NotOnThisStage:
    """lm_head of a stage before the last: never called."""

    nbytes = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("lm_head lives on the last pipeline stage")


def stage_factory(inner: LinearFactory, plan: StagePlan) -> LinearFactory:
    """`inner` asked with the checkpoint's layer numbers (so quantized files and GGUF blocks match)."""
    offset = plan.layers()[0]

    def make(name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearLayer:
        if name == "lm_head" and not plan.last:
            return _NotOnThisStage()
        m = _LOCAL_LAYER.fullmatch(name)
        if m is not None:
            name = f"layers.{int(m.group(2)) + offset}.{m.group(3)}"
        return inner(name, weight, bias)

    return make


class StageDecoder(Decoder):
    """A Decoder over one stage's layers: starts from the received residual stream (stage > 0) and
    ends at the residual stream (stage < last)."""

    def __init__(self, plan: StagePlan, state: StageState, dtype: torch.dtype, max_len: int,
                 linear_factory: LinearFactory, **options: Any):
        self.plan = plan
        self.hidden_in: torch.Tensor | None = None
        options["native_loop"] = False  # the C++ loop runs a whole model from its embedding
        super().__init__(plan.local_config(), state, dtype, max_len, stage_factory(linear_factory, plan), **options)
        self.returns_residual = not plan.last

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.plan.first:
            return super()._embed(input_ids)
        assert self.hidden_in is not None
        return self.hidden_in

    def weight_bytes(self) -> int:
        from hasten.distributed.layers import decoder_weight_bytes

        return decoder_weight_bytes(self)


class PipelineStage:
    """What every rank runs for one step: its layers over each micro-batch, in order."""

    def __init__(self, model: StageDecoder, runner: ModelRunner, group: ParallelGroup):
        self.model = model
        self.runner = runner
        self.group = group

    def run(self, steps: list[StepInputs]) -> list[tuple[torch.Tensor | None, list[torch.Tensor]]]:
        """Rank 0 gets each micro-batch's (sampled logits, prompt-span logits); the other ranks []."""
        plan, model, group = self.model.plan, self.model, self.group
        stage, last = plan.stage, plan.stages - 1
        hidden = plan.cfg.hidden_size
        pending = []
        for m, st in enumerate(steps):
            if stage > 0:
                model.hidden_in = torch.empty(st.input_ids.shape[0], hidden, dtype=model.dtype)
                group.recv(model.hidden_in, stage - 1, m)
            out = model.forward(st.input_ids, st.positions, st.meta, self.runner.kv_caches)
            model.hidden_in = None
            if stage < last:
                pending.append(group.isend(out.contiguous(), stage + 1, m))
                continue
            rows = _logit_rows(st)
            if rows is not None:
                pending.append(group.isend(model.logits(out[rows]).contiguous(), 0, m))
        for work in pending:
            group.wait(work)
        if stage != 0:
            return []
        results = []
        vocab = plan.cfg.vocab_size
        for m, st in enumerate(steps):
            rows = _logit_rows(st)
            if rows is None:
                results.append((None, []))
                continue
            logits = torch.empty(rows.shape[0], vocab)
            group.recv(logits, last, m)
            n = st.sample_rows.shape[0] if st.sample_rows is not None else 0
            spans, start = [], n
            for _, count in st.prompt_spans:
                spans.append(logits[start : start + count])
                start += count
            results.append((logits[:n] if st.sample_rows is not None else None, spans))
        return results


def _logit_rows(step: StepInputs) -> torch.Tensor | None:
    """The hidden rows whose logits go back to rank 0: the sampled rows, then each prompt span's."""
    parts = [step.sample_rows] if step.sample_rows is not None else []
    parts += [torch.arange(first, first + count) for first, count in step.prompt_spans]
    return torch.cat(parts) if parts else None


def split_batch(batch: ScheduledBatch, parts: int) -> list[ScheduledBatch]:
    """Up to `parts` micro-batches of consecutive sequences with about equal token counts."""
    n = len(batch.requests)
    parts = max(1, min(parts, n))
    target = batch.total_tokens / parts
    out: list[ScheduledBatch] = []
    cur = ScheduledBatch()
    done = 0
    for i, (req, k) in enumerate(zip(batch.requests, batch.num_new_tokens, strict=True)):
        cur.requests.append(req)
        cur.num_new_tokens.append(k)
        done += k
        left_parts = parts - len(out) - 1
        if left_parts > 0 and (done >= target * (len(out) + 1) or n - i - 1 == left_parts):
            out.append(cur)
            cur = ScheduledBatch()
    if cur.requests:
        out.append(cur)
    return out


class PipelineModelRunner(ModelRunner):
    """Rank 0's runner: the batch in micro-batches through every stage."""

    def __init__(self, model: StageDecoder, group: ParallelGroup, *args: Any, **kwargs: Any):
        super().__init__(model, *args, **kwargs)
        self.group = group
        self.stage = PipelineStage(model, self, group)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        if self.group.closed:
            raise TensorParallelError("the pipeline-parallel group is closed")
        prepared = [self.prepare(b) for b in split_batch(batch, self.model.plan.stages)]
        steps = [p.step for p in prepared]
        self.group.broadcast_object(("pipeline", steps))
        results = [p.result(*out) for p, out in zip(prepared, self.stage.run(steps), strict=True)]
        logits = [r.logits for r in results if r.logits is not None]
        return StepResult([q for r in results for q in r.sample_requests], torch.cat(logits) if logits else None,
                          [k for r in results for k in r.num_rows],
                          {k: v for r in results for k, v in r.prompt_logits.items()})
