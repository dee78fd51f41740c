"""Perplexity and top-1 agreement of a (quantized) decoder against the unquantized one.

Sequences are run through `Decoder.forward` as one causal prefill each, over a private
paged KV cache, so exactly the production layers (kernels included) are measured.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from hasten.model.decoder import Decoder
from hasten.model.dtypes import kv_row_width
from hasten.model.layers import resolve_attention_backend, single_sequence_metadata

_BLOCK = 16


def prefill_hidden(decoder: Decoder, ids: list[int], kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Final-norm hidden states [T, hidden] of one sequence, computed as a single causal prefill
    (its keys and values written to, and read back from, a cache of kv_dtype; default: the model's)."""
    cfg = decoder.cfg
    t = len(ids)
    nblocks = -(-t // _BLOCK)
    kv_dtype = kv_dtype or decoder.dtype
    shape = (nblocks, _BLOCK, cfg.num_kv_heads, kv_row_width(cfg.head_dim, kv_dtype))
    caches = [(torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype)) for _ in range(cfg.num_layers)]
    meta = single_sequence_metadata(t, _BLOCK, resolve_attention_backend("auto"))
    pos = torch.arange(t)
    return decoder.forward(torch.tensor(ids, dtype=torch.long), pos, meta, caches)


@torch.inference_mode()
def sequence_logits(decoder: Decoder, ids: list[int], kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """float32 logits [T, V] for every position of `ids`."""
    return decoder.logits(prefill_hidden(decoder, ids, kv_dtype))


@dataclass
class PerplexityResult:
    perplexity: float
    reference_perplexity: float | None
    top1_agreement: float | None  # share of positions whose argmax equals the reference's
    num_tokens: int
    num_sequences: int

    @property
    def increase(self) -> float | None:
        if self.reference_perplexity is None:
            return None
        return self.perplexity / self.reference_perplexity - 1.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["increase"] = self.increase
        return d


@torch.inference_mode()
def evaluate(
    decoder: Decoder,
    sequences: list[list[int]],
    reference: Decoder | None = None,
    reference_logits: list[torch.Tensor] | None = None,
    kv_dtype: torch.dtype | None = None,
) -> PerplexityResult:
    """Perplexity of next-token prediction over `sequences`; with `reference` (or its logits per
    sequence, precomputed by `sequence_logits`), its perplexity and the top-1 agreement. kv_dtype:
    the evaluated decoder's KV cache type (the reference keeps its model's)."""
    nll, ref_nll, agree, count = 0.0, 0.0, 0, 0
    has_ref = reference is not None or reference_logits is not None
    for i, ids in enumerate(sequences):
        if len(ids) < 2:
            continue
        target = torch.tensor(ids[1:], dtype=torch.long)
        logits = sequence_logits(decoder, ids, kv_dtype)[:-1]
        nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        if has_ref:
            full = reference_logits[i] if reference_logits is not None else sequence_logits(reference, ids)
            ref_logits = full[:-1]
            ref_nll += torch.nn.functional.cross_entropy(ref_logits, target, reduction="sum").item()
            agree += int((logits.argmax(-1) == ref_logits.argmax(-1)).sum())
        count += len(ids) - 1
    if count == 0:
        raise ValueError("no evaluation tokens")
    return PerplexityResult(
        perplexity=math.exp(nll / count),
        reference_perplexity=math.exp(ref_nll / count) if has_ref else None,
        top1_agreement=agree / count if has_ref else None,
        num_tokens=count,
        num_sequences=len(sequences),
    )
