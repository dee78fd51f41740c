"""The Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.

Weights are held in small dataclasses; every projection is a callable built by a
`LinearFactory` (float by default, quantized layouts from hasten.quant). q/k/v and gate/up
are fused into one matmul each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hasten.model.config import ModelConfig
from hasten.model.layers import AttentionMetadata, RotaryEmbedding, apply_rope, paged_attention, rms_norm
from hasten.model.linear import LinearFactory, LinearLayer, dense_factory


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv_proj: LinearLayer  # fused [q; k; v] rows (with bias for Qwen2)
    o_proj: LinearLayer
    gate_up_proj: LinearLayer  # fused [gate; up] rows
    down_proj: LinearLayer
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


class Decoder:
    def __init__(
        self,
        cfg: ModelConfig,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype,
        max_len: int,
        linear_factory: LinearFactory | None = None,
        quantize_lm_head: bool = True,
        fused_ops: bool = True,
        native_loop: bool = True,
        attention_group: int = 8,
    ):
        """Build from a HF-named state dict; `linear_factory` decides how each projection is stored.

        fused_ops: run the glue between matmuls (norms, RoPE + cache write, SiLU-mul, residual adds)
        as hasten's C++ ops (hasten/kernels/decoder_ops_cpu.cpp) when they build; else PyTorch ops.
        native_loop: with fused_ops and the C++ attention kernel, run the whole layer loop in C++
        (hasten/kernels/decoder_loop_cpu.cpp: same calls, bit-identical, minus Python's overhead).
        attention_group: the C++ attention kernel's max_group (decode sequences that share prefix
        blocks read them once; bit-identical; < 2 switches it off).
        """
        self.cfg = cfg
        self.dtype = dtype
        self.ops = None
        if fused_ops:
            from hasten.kernels import decoder_ops

            self.ops = decoder_ops.load()
        make = linear_factory or dense_factory

        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise KeyError(f"weight {name!r} missing from checkpoint")
            return state[name].to(dtype).contiguous()

        def maybe(name: str) -> torch.Tensor | None:
            return take(name) if name in state else None

        self.embed = take("model.embed_tokens.weight")
        self.final_norm = take("model.norm.weight")
        head = self.embed if cfg.tie_word_embeddings or "lm_head.weight" not in state else take("lm_head.weight")
        self.lm_head: LinearLayer = make("lm_head", head, None) if quantize_lm_head else dense_factory("lm_head", head, None)
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            biases = [maybe(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
            qkv_bias = torch.cat(biases) if biases[0] is not None else None
            gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            self.layers.append(
                LayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    qkv_proj=make(f"layers.{i}.qkv_proj", qkv.contiguous(), qkv_bias),
                    o_proj=make(f"layers.{i}.o_proj", take(p + "self_attn.o_proj.weight"), None),
                    gate_up_proj=make(f"layers.{i}.gate_up_proj", gate_up.contiguous(), None),
                    down_proj=make(f"layers.{i}.down_proj", take(p + "mlp.down_proj.weight"), None),
                    q_norm=maybe(p + "self_attn.q_norm.weight"),
                    k_norm=maybe(p + "self_attn.k_norm.weight"),
                )
            )
        self.rope = RotaryEmbedding(cfg, max_len, dtype)
        self.scale = cfg.head_dim**-0.5
        self.attention_group = attention_group
        self.loop = None  # the C++ layer loop (float32 models with the fused ops only)
        if native_loop and self.ops is not None:
            from hasten.model.native_loop import build_decoder_loop

            self.loop = build_decoder_loop(self)
            if self.loop is not None:
                self.loop.set_attention_group(attention_group)

    # ---------------------------------------------------------------- forward

    def _mlp(self, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate_up = lw.gate_up_proj(x)
        inter = gate_up.shape[-1] // 2
        return lw.down_proj(F.silu(gate_up[:, :inter]) * gate_up[:, inter:])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """input_ids, positions: [T]. Returns the final-norm hidden states [T, hidden]."""
        if self.loop is not None and meta.block_tables is not None:
            return self.loop.forward(input_ids, positions, meta.slot_mapping, meta.block_tables, meta.query_start,
                                     meta.context_lens, [k for k, _ in kv_caches], [v for _, v in kv_caches])
        if self.ops is not None:
            return self._forward_fused(input_ids, positions, meta, kv_caches)
        cfg = self.cfg
        t = input_ids.shape[0]
        cos, sin = self.rope.lookup(positions)
        qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        h = self.embed[input_ids]
        for lw, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = rms_norm(h, lw.input_norm, cfg.rms_norm_eps)
            qkv = lw.qkv_proj(x)
            v = qkv[:, qd + kd :].reshape(t, cfg.num_kv_heads, cfg.head_dim)
            if lw.q_norm is not None:
                q = rms_norm(qkv[:, :qd].reshape(t, cfg.num_heads, cfg.head_dim), lw.q_norm, cfg.rms_norm_eps)
                k = rms_norm(qkv[:, qd : qd + kd].reshape(t, cfg.num_kv_heads, cfg.head_dim), lw.k_norm, cfg.rms_norm_eps)
                qk = torch.cat([q, k], dim=1)
            else:
                qk = qkv[:, : qd + kd].reshape(t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
            qk = apply_rope(qk, cos, sin)  # q and k heads rotated together
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
            flat_k = k_cache.view(-1, cfg.num_kv_heads, cfg.head_dim)
            flat_v = v_cache.view(-1, cfg.num_kv_heads, cfg.head_dim)
            flat_k.index_copy_(0, meta.slot_mapping, k.to(flat_k.dtype))
            flat_v.index_copy_(0, meta.slot_mapping, v.to(flat_v.dtype))
            attn = paged_attention(q, k_cache, v_cache, meta, cfg.num_kv_heads, self.scale, self.attention_group)
            h = h + lw.o_proj(attn)
            x = rms_norm(h, lw.post_norm, cfg.rms_norm_eps)
            h = h + self._mlp(lw, x)
        return rms_norm(h, self.final_norm, cfg.rms_norm_eps)

    def _forward_fused(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """forward() with the glue in C++: per layer 4 matmuls, attention and 4 small fused calls."""
        cfg, ops = self.cfg, self.ops
        eps, heads, kv_heads, d = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qd, kd = heads * d, kv_heads * d
        slots = meta.slot_mapping
        h = self.embed[input_ids]  # the residual stream, updated in place by add_rms_norm
        x = ops.rms_norm(h, self.layers[0].input_norm, eps)
        last = len(self.layers) - 1
        for i, (lw, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            qkv = _contiguous(lw.qkv_proj(x))
            if lw.q_norm is not None:  # Qwen3: per-head RMSNorm of q and k before RoPE
                t = qkv.shape[0]
                q = ops.rms_norm(qkv[:, :qd].reshape(-1, d), lw.q_norm, eps).view(t, qd)
                k = ops.rms_norm(qkv[:, qd : qd + kd].reshape(-1, d), lw.k_norm, eps).view(t, kd)
                qkv = torch.cat([q, k, qkv[:, qd + kd :]], dim=1)
            q = ops.rope_and_cache(qkv, self.rope.cos, self.rope.sin, positions, slots, k_cache, v_cache, heads, kv_heads)
            attn = paged_attention(q, k_cache, v_cache, meta, kv_heads, self.scale, self.attention_group)
            x = ops.add_rms_norm(h, _contiguous(lw.o_proj(attn)), lw.post_norm, eps)
            down = _contiguous(lw.down_proj(ops.silu_mul(_contiguous(lw.gate_up_proj(x)))))
            norm = self.final_norm if i == last else self.layers[i + 1].input_norm
            x = ops.add_rms_norm(h, down, norm, eps)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()
