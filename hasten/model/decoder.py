"""The Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.

Weights are plain tensors held in small dataclasses; the forward pass is a handful of
matmuls per layer. q/k/v and gate/up projections are fused into one matmul each when
`fuse_projections` is on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hasten.model.config import ModelConfig
from hasten.model.layers import AttentionMetadata, RotaryEmbedding, apply_rope, paged_attention, rms_norm


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    o_proj: torch.Tensor
    down_proj: torch.Tensor
    qkv_proj: torch.Tensor | None = None  # fused [q; k; v] rows
    qkv_bias: torch.Tensor | None = None
    q_proj: torch.Tensor | None = None
    k_proj: torch.Tensor | None = None
    v_proj: torch.Tensor | None = None
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    gate_up_proj: torch.Tensor | None = None  # fused [gate; up] rows
    gate_proj: torch.Tensor | None = None
    up_proj: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


class Decoder:
    def __init__(
        self,
        cfg: ModelConfig,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype,
        max_len: int,
        fuse_projections: bool = True,
    ):
        self.cfg = cfg
        self.dtype = dtype
        self.fused = fuse_projections

        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise KeyError(f"weight {name!r} missing from checkpoint")
            return state[name].to(dtype).contiguous()

        def maybe(name: str) -> torch.Tensor | None:
            return take(name) if name in state else None

        self.embed = take("model.embed_tokens.weight")
        self.final_norm = take("model.norm.weight")
        if cfg.tie_word_embeddings or "lm_head.weight" not in state:
            self.lm_head = self.embed
        else:
            self.lm_head = take("lm_head.weight")
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            q, k, v = (take(p + f"self_attn.{n}_proj.weight") for n in "qkv")
            qb, kb, vb = (maybe(p + f"self_attn.{n}_proj.bias") for n in "qkv")
            gate, up = take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")
            lw = LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                post_norm=take(p + "post_attention_layernorm.weight"),
                o_proj=take(p + "self_attn.o_proj.weight"),
                down_proj=take(p + "mlp.down_proj.weight"),
                q_norm=maybe(p + "self_attn.q_norm.weight"),
                k_norm=maybe(p + "self_attn.k_norm.weight"),
            )
            if fuse_projections:
                lw.qkv_proj = torch.cat([q, k, v]).contiguous()
                if qb is not None:
                    lw.qkv_bias = torch.cat([qb, kb, vb]).contiguous()
                lw.gate_up_proj = torch.cat([gate, up]).contiguous()
            else:
                lw.q_proj, lw.k_proj, lw.v_proj = q, k, v
                lw.q_bias, lw.k_bias, lw.v_bias = qb, kb, vb
                lw.gate_proj, lw.up_proj = gate, up
            self.layers.append(lw)
        self.rope = RotaryEmbedding(cfg, max_len, dtype)
        self.scale = cfg.head_dim**-0.5

    # ---------------------------------------------------------------- forward

    def _qkv(self, lw: LayerWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        if self.fused:
            qkv = F.linear(x, lw.qkv_proj, lw.qkv_bias)
            return qkv[:, :qd], qkv[:, qd : qd + kd], qkv[:, qd + kd :]
        return F.linear(x, lw.q_proj, lw.q_bias), F.linear(x, lw.k_proj, lw.k_bias), F.linear(x, lw.v_proj, lw.v_bias)

    def _mlp(self, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate_up = F.linear(x, lw.gate_up_proj)
            inter = gate_up.shape[-1] // 2
            h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        else:
            h = F.silu(F.linear(x, lw.gate_proj)) * F.linear(x, lw.up_proj)
        return F.linear(h, lw.down_proj)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """input_ids, positions: [T]. Returns the final-norm hidden states [T, hidden]."""
        cfg = self.cfg
        t = input_ids.shape[0]
        cos, sin = self.rope.lookup(positions)
        h = self.embed[input_ids]
        for lw, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = rms_norm(h, lw.input_norm, cfg.rms_norm_eps)
            q, k, v = self._qkv(lw, x)
            q = q.reshape(t, cfg.num_heads, cfg.head_dim)
            k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
            if lw.q_norm is not None:
                q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps)
                k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            flat_k = k_cache.view(-1, cfg.num_kv_heads, cfg.head_dim)
            flat_v = v_cache.view(-1, cfg.num_kv_heads, cfg.head_dim)
            flat_k.index_copy_(0, meta.slot_mapping, k)
            flat_v.index_copy_(0, meta.slot_mapping, v)
            attn = paged_attention(q, k_cache, v_cache, meta, cfg.num_kv_heads, self.scale)
            h = h + F.linear(attn, lw.o_proj)
            x = rms_norm(h, lw.post_norm, cfg.rms_norm_eps)
            h = h + self._mlp(lw, x)
        return rms_norm(h, self.final_norm, cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()
