"""A HF-named state dict -> the decoder's per-layer weights (fused q/k/v and gate/up projections).

Every supported family stores its layers under model.layers.{i}. The projections are either
separate (q_proj / k_proj / v_proj, gate_proj / up_proj: Llama, Mistral, Qwen, Gemma, Granite) or
already fused in the decoder's layout (qkv_proj = [q; k; v], gate_up_proj = [gate; up]: Phi-3).
Norm weights get the family's offset folded in (Gemma's RMSNorm scales by 1 + weight), so one
RMSNorm serves every family. With sandwich norms (Gemma) the layer has four: input_layernorm,
post_attention_layernorm (on the attention output), pre_feedforward_layernorm (before the MLP) and
post_feedforward_layernorm (on the MLP output). A mixture-of-experts layer holds a router and its
experts (hasten/model/moe.py) instead of gate_up_proj / down_proj.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hasten.model.config import ModelConfig
from hasten.model.linear import LinearFactory, LinearLayer
from hasten.model.moe import MoEWeights, load_moe


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor  # the norm before the MLP
    qkv_proj: LinearLayer  # fused [q; k; v] rows (with bias for Qwen2)
    o_proj: LinearLayer
    gate_up_proj: LinearLayer | None  # fused [gate; up] rows (None in a MoE layer)
    down_proj: LinearLayer | None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # sandwich norms (Gemma): on the attention output
    mlp_out_norm: torch.Tensor | None = None  # ... and on the MLP output
    moe: MoEWeights | None = None  # a mixture-of-experts MLP in place of gate_up_proj / down_proj


class StateReader:
    """Takes tensors out of a state dict in the model dtype, contiguous, with clear errors."""

    def __init__(self, state: dict[str, torch.Tensor], dtype: torch.dtype, norm_offset: float = 0.0,
                 device: torch.device | str = "cpu"):
        self.state = state
        self.dtype = dtype
        self.norm_offset = norm_offset
        self.device = torch.device(device)

    def __contains__(self, name: str) -> bool:
        return name in self.state

    def take(self, name: str) -> torch.Tensor:
        if name not in self.state:
            raise KeyError(f"weight {name!r} missing from checkpoint")
        return self.state[name].to(self.device, self.dtype).contiguous()

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.take(name) if name in self.state else None

    def norm(self, name: str) -> torch.Tensor:
        """An RMSNorm weight with the family's offset added in float32 (as transformers computes 1 + w)."""
        if not self.norm_offset:
            return self.take(name)
        if name not in self.state:
            raise KeyError(f"weight {name!r} missing from checkpoint")
        return (self.state[name].float() + self.norm_offset).to(self.device, self.dtype).contiguous()

    def maybe_norm(self, name: str) -> torch.Tensor | None:
        return self.norm(name) if name in self.state else None

    def fused(self, prefix: str, fused_name: str, parts: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) of `prefix + fused_name` if the checkpoint stores it fused, else the parts concatenated."""
        if f"{prefix}{fused_name}.weight" in self.state:
            return self.take(f"{prefix}{fused_name}.weight"), self.maybe(f"{prefix}{fused_name}.bias")
        weight = torch.cat([self.take(f"{prefix}{n}.weight") for n in parts])
        biases = [self.maybe(f"{prefix}{n}.bias") for n in parts]
        if all(b is None for b in biases):
            return weight.contiguous(), None
        if any(b is None for b in biases):
            raise KeyError(f"{prefix}: some of {parts} have a bias and some do not")
        return weight.contiguous(), torch.cat(biases)  # type: ignore[arg-type]


def load_layer(cfg: ModelConfig, reader: StateReader, i: int, make: LinearFactory) -> LayerWeights:
    p = f"model.layers.{i}."
    qkv, qkv_bias = reader.fused(p + "self_attn.", "qkv_proj", ("q_proj", "k_proj", "v_proj"))
    expected = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    if qkv.shape[0] != expected:
        raise ValueError(f"layer {i}: q/k/v projections have {qkv.shape[0]} rows, the config implies {expected}")
    qkv_proj = make(f"layers.{i}.qkv_proj", qkv, qkv_bias)
    o_proj = make(f"layers.{i}.o_proj", reader.take(p + "self_attn.o_proj.weight"), reader.maybe(p + "self_attn.o_proj.bias"))
    moe = gate_up_proj = down_proj = None
    if cfg.is_moe(i):
        moe = load_moe(cfg.arch, reader, i, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, make)
    else:
        gate_up, gate_up_bias = reader.fused(p + "mlp.", "gate_up_proj", ("gate_proj", "up_proj"))
        gate_up_proj = make(f"layers.{i}.gate_up_proj", gate_up, gate_up_bias)
        down_proj = make(f"layers.{i}.down_proj", reader.take(p + "mlp.down_proj.weight"),
                         reader.maybe(p + "mlp.down_proj.bias"))
    sandwich = cfg.sandwich_norms
    return LayerWeights(
        input_norm=reader.norm(p + "input_layernorm.weight"),
        post_norm=reader.norm(p + ("pre_feedforward_layernorm" if sandwich else "post_attention_layernorm") + ".weight"),
        qkv_proj=qkv_proj,
        o_proj=o_proj,
        gate_up_proj=gate_up_proj,
        down_proj=down_proj,
        q_norm=reader.maybe_norm(p + "self_attn.q_norm.weight"),
        k_norm=reader.maybe_norm(p + "self_attn.k_norm.weight"),
        attn_out_norm=reader.norm(p + "post_attention_layernorm.weight") if sandwich else None,
        mlp_out_norm=reader.norm(p + "post_feedforward_layernorm.weight") if sandwich else None,
        moe=moe,
    )
