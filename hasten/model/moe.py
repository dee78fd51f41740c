"""Mixture-of-experts MLPs: Mixtral, Qwen3-MoE and OLMoE.

A router (a dense [experts, hidden] matrix, never quantized) scores every token; the softmax's top-k
experts each run the token through their own SiLU-gated MLP and the outputs are summed, weighted by
the top-k probabilities (renormalised to sum to 1 for Mixtral, and for Qwen3-MoE / OLMoE when the
config sets norm_topk_prob). The fused path groups the step's tokens by expert: one gather, then
per active expert one gate_up and one down matmul over all of its tokens, then one scatter-add. The
experts' projections come from the model's LinearFactory, so int8 / int4 experts work as any layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hasten.model.linear import LinearFactory, LinearLayer

MOE_FAMILIES = ("mixtral", "qwen3_moe", "olmoe")


def moe_fields(cfg: dict[str, Any], family: str, num_layers: int) -> dict[str, Any]:
    """The ModelConfig fields of a MoE family's config.json."""
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if experts < 1 or not 1 <= top_k <= experts:
        raise ValueError(f"mixture of experts needs 1 <= num_experts_per_tok <= num_experts, got {top_k} of {experts}")
    if family == "qwen3_moe":
        dense = set(cfg.get("mlp_only_layers") or [])
        step = int(cfg.get("decoder_sparse_step") or 1)
        layers = [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]
    else:
        layers = [True] * num_layers
    fields: dict[str, Any] = dict(num_experts=experts, num_experts_per_tok=top_k, moe_layers=layers,
                                  norm_topk_prob=family == "mixtral" or bool(cfg.get("norm_topk_prob", False)))
    if family == "olmoe":
        fields.update(qk_norm=True, qk_norm_full=True, clip_qkv=cfg.get("clip_qkv"))
    return fields


@dataclass
class MoEWeights:
    router: torch.Tensor  # [experts, hidden] in the model dtype
    gate_up: list[LinearLayer]  # per expert: fused [gate; up] rows
    down: list[LinearLayer]
    top_k: int
    renormalize: bool
    weights_in_float: bool  # Mixtral scales the expert outputs in float32; Qwen3-MoE / OLMoE in the model dtype


# where each family keeps its experts: (block prefix, gate, up, down)
EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe.", "w1", "w3", "w2"),
    "qwen3_moe": ("mlp.", "gate_proj", "up_proj", "down_proj"),
    "olmoe": ("mlp.", "gate_proj", "up_proj", "down_proj"),
}


def load_moe(family: str, reader: Any, layer: int, num_experts: int, top_k: int, renormalize: bool,
             make: LinearFactory) -> MoEWeights:
    """Layer `layer`'s router and experts from a HF-named state dict (`reader`: a weights.StateReader)."""
    block, gate, up, down = EXPERT_NAMES[family]
    p = f"model.layers.{layer}.{block}"
    gate_ups, downs = [], []
    for e in range(num_experts):
        q = f"{p}experts.{e}."
        fused = torch.cat([reader.take(f"{q}{gate}.weight"), reader.take(f"{q}{up}.weight")]).contiguous()
        gate_ups.append(make(f"layers.{layer}.experts.{e}.gate_up_proj", fused, None))
        downs.append(make(f"layers.{layer}.experts.{e}.down_proj", reader.take(f"{q}{down}.weight"), None))
    router = reader.take(f"{p}gate.weight")
    if router.shape[0] != num_experts:
        raise ValueError(f"layer {layer}: the router scores {router.shape[0]} experts, the config has {num_experts}")
    return MoEWeights(router, gate_ups, downs, top_k, renormalize, weights_in_float=family == "mixtral")


def route(moe: MoEWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k weights [T, k] float32, expert ids [T, k]) for tokens x [T, hidden]."""
    probs = torch.softmax(F.linear(x, moe.router), dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, moe.top_k, dim=-1)
    if moe.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def moe_forward(moe: MoEWeights, x: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor],
                silu_mul: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The MoE block's output [T, hidden] for its input x [T, hidden] (already normed).

    silu_mul: the fused C++ SiLU-and-multiply over a [rows, 2 * inter] gate_up, when available.
    """
    weights, experts = route(moe, x)
    k = moe.top_k
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert, tokens in order within each
    counts = torch.bincount(flat, minlength=len(moe.gate_up)).tolist()
    token_of = order // k
    rows = x.index_select(0, token_of)
    outs = []
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        gate_up = moe.gate_up[e](rows[start : start + n])
        if silu_mul is not None:
            hidden = silu_mul(gate_up if gate_up.is_contiguous() else gate_up.contiguous())
        else:
            inter = gate_up.shape[-1] // 2
            hidden = act(gate_up[:, :inter]) * gate_up[:, inter:]
        outs.append(moe.down[e](hidden))
        start += n
    y = torch.cat(outs)
    w = weights.reshape(-1)[order].unsqueeze(1)
    y = (y.float() * w).to(x.dtype) if moe.weights_in_float else y * w.to(x.dtype)
    out = torch.zeros_like(x)
    out.index_add_(0, token_of, y)
    return out
