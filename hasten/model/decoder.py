"""The decoder over a paged KV cache: the Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) and
the families that differ from it by a few switches in ModelConfig (Gemma 2 / 3, Phi-3 / Phi-4, Granite,
and the mixture-of-experts Mixtral, Qwen3-MoE and OLMoE, whose MLPs are hasten/model/moe.py's).

Weights are held in small dataclasses (hasten/model/weights.py); every projection is a callable
built by a `LinearFactory` (float by default, quantized layouts from hasten.quant). q/k/v and
gate/up are fused into one matmul each. Per layer the decoder knows its sliding window (0: none)
and its RoPE table (Gemma 3's sliding-window layers have their own theta).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hasten.model.config import ModelConfig
from hasten.model.layers import AttentionMetadata, paged_attention, rms_norm, rows_metadata
from hasten.model.linear import LinearFactory, LinearLayer, dense_factory
from hasten.model.moe import moe_forward
from hasten.model.rope import RotaryEmbedding, apply_rope
from hasten.model.weights import LayerWeights, StateReader, load_layer

__all__ = ["Decoder", "LayerWeights", "PrefillAttention", "prefill_attention"]


@dataclass(frozen=True)
class PrefillAttention:
    """How the C++ attention kernel serves sequences with many new tokens (prefill chunks); 0: off.
    bf16_rows: from that many, bfloat16 SDPA over the gathered keys and values (attention_bf16);
    int8_rows: from that many, over an int8 cache, scores of q rounded to int8 against the cache's key
    codes (attention_int8_scores; paged_attention's int8_rows); bf16_pv: those rows' P V as bfloat16 dot
    products (attention_bf16_pv; paged_attention's int8_bf16_pv); amx: those rows on AMX tiles
    (attention_amx; paged_attention's int8_tiles). int8_decode: the sequences with fewer new tokens
    (decodes), over an int8 cache, score q rounded to int8 against the key codes read in place
    (attention_int8_decode; paged_attention's int8_decode). lane_tokens: from that many new tokens per tile,
    over an int8 / float16 / bfloat16 cache, the query rows in the vector lanes (attention_lane_tiles;
    paged_attention's lane_tokens). spread_prefetch: every walk over cache blocks requests the block ahead a
    few lines per step of its loops (attention_spread_prefetch; paged_attention's spread_prefetch)."""

    bf16_rows: int = 0
    int8_rows: int = 0
    bf16_pv: bool = False
    amx: bool = False
    int8_decode: bool = False
    lane_tokens: int = 0
    spread_prefetch: bool = True

ACTIVATION_FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


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
        device: torch.device | str = "cpu",
        ops: Any = None,
    ):
        """Build from a HF-named state dict; `linear_factory` decides how each projection is stored.

        fused_ops: run the glue between matmuls (norms, RoPE + cache write, SiLU-mul, residual adds)
        as hasten's C++ ops (hasten/kernels/decoder_ops_cpu.cpp) when they build; else PyTorch ops.
        native_loop: with fused_ops and the C++ attention kernel, run the whole layer loop in C++
        (hasten/kernels/decoder_loop_cpu.cpp: same calls, bit-identical, minus Python's overhead)
        for the models it covers (hasten/model/native_loop.py).
        attention_group: the C++ attention kernel's max_group (decode sequences that share prefix
        blocks read them once; bit-identical; < 2 switches it off).
        device: where the weights and the RoPE tables live (the step's tensors must be there too).
        ops: the fused glue to use instead of the C++ ops (the Triton ops of hasten/runtime/device.py);
        no native loop then.
        """
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.ops = ops
        if ops is None and fused_ops and self.device.type == "cpu":
            from hasten.kernels import decoder_ops

            self.ops = decoder_ops.load()
        make = linear_factory or dense_factory
        reader = StateReader(state, dtype, cfg.norm_offset, self.device)
        self.embed = reader.take("model.embed_tokens.weight")
        self.final_norm = reader.norm("model.norm.weight")
        head = self.embed if cfg.tie_word_embeddings or "lm_head.weight" not in reader else reader.take("lm_head.weight")
        self.lm_head: LinearLayer = make("lm_head", head, None) if quantize_lm_head else dense_factory("lm_head", head, None)
        self.layers: list[LayerWeights] = [load_layer(cfg, reader, i, make) for i in range(cfg.num_layers)]
        # the global layers' (the only one mostly)
        self.rope = RotaryEmbedding(cfg.rope_spec(), max_len, dtype, self.device)
        local = (RotaryEmbedding(cfg.rope_spec(local=True), max_len, dtype, self.device)
                 if cfg.local_rope_theta is not None else None)
        self.layer_ropes = [local if local is not None and cfg.uses_local_rope(i) else self.rope
                            for i in range(cfg.num_layers)]
        # a window that covers max_len changes nothing: 0 keeps the kernel's prefix groups
        self.windows = cfg.windows_within(max_len)
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim**-0.5
        self.softcap = float(cfg.attn_softcap or 0.0)
        # Gemma rounds sqrt(hidden) to the model dtype before multiplying, as transformers does
        self.embed_scale = torch.tensor(cfg.embed_scale).to(self.device, dtype) if cfg.embed_scale != 1.0 else None
        self.act = ACTIVATION_FNS[cfg.hidden_act]
        self.attention_group = attention_group
        self.prefill_attention = PrefillAttention()  # set_prefill_attention
        self.fast_silu = False  # set_fast_silu
        self.last_layer_sampled_rows = False  # forward(out_rows=...): the last layer for those rows only
        self.returns_residual = False  # a pipeline stage before the last: forward() ends at the residual stream
        self.loop = None  # the C++ layer loop (float32 models with the fused ops only)
        if native_loop and self.ops is not None and ops is None:
            from hasten.model.native_loop import build_decoder_loop

            self.loop = build_decoder_loop(self)
            if self.loop is not None:
                self.loop.set_attention_group(attention_group)

    def set_prefill_attention(self, paths: PrefillAttention) -> None:
        """The C++ attention kernel's paths for sequences with many new tokens (PrefillAttention)."""
        self.prefill_attention = paths
        if self.loop is not None:
            self.loop.set_wide_attention_rows(paths.bf16_rows)
            self.loop.set_int8_attention_rows(paths.int8_rows)
            self.loop.set_bf16_pv(paths.bf16_pv)
            self.loop.set_int8_tiles(paths.amx)
            self.loop.set_int8_decode(paths.int8_decode)
            self.loop.set_lane_tokens(paths.lane_tokens)
            self.loop.set_spread_prefetch(paths.spread_prefetch)

    def apply_cpu_switches(self, config: Any) -> None:
        """An EngineConfig's switches of the CPU paths: prefill attention (prefill_attention), fast_silu,
        quant_bf16_gemm_silu, quant_u8_gemm_silu, quant_int4_gemm_silu and last_layer_sampled_rows."""
        self.set_prefill_attention(prefill_attention(self, config))
        self.set_fast_silu(config.fast_silu)
        if self.loop is not None:
            self.loop.set_gemm_silu(bool(config.quant_bf16_gemm_silu))
            self.loop.set_u8_silu(bool(config.quant_u8_gemm_silu))
            self.loop.set_int4_silu(bool(config.quant_int4_gemm_silu))
        self.last_layer_sampled_rows = bool(config.last_layer_sampled_rows)

    def set_fast_silu(self, on: bool) -> None:
        """on: the fused SiLU-multiply takes its vectorized exp (~2 ulp) wherever the down projection
        rounds its input anyway (int8 or bfloat16 activations); float32-exact layers never do."""
        self.fast_silu = bool(on)
        if self.loop is not None:
            self.loop.set_fast_silu(self.fast_silu)

    # ---------------------------------------------------------------- forward

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed[input_ids]
        return h * self.embed_scale if self.embed_scale is not None else h

    def _branch(self, delta: torch.Tensor) -> torch.Tensor:
        """A residual branch's output as it is added (Granite scales it)."""
        scale = self.cfg.residual_scale
        return delta * scale if scale != 1.0 else delta

    def _mlp(self, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        if lw.moe is not None:
            silu_mul = self.ops.silu_mul if self.ops is not None and self.cfg.hidden_act == "silu" else None
            return moe_forward(lw.moe, x, self.act, silu_mul)
        gate_up = lw.gate_up_proj(x)
        inter = gate_up.shape[-1] // 2
        return lw.down_proj(self.act(gate_up[:, :inter]) * gate_up[:, inter:])

    def _qk_norm(self, lw: LayerWeights, qkv: torch.Tensor, norm: Callable[..., torch.Tensor]) -> torch.Tensor:
        """q and k RMSNormed before RoPE, per head (Qwen3, Gemma 3) or over the whole projection
        (OLMoE), then q, k and v clamped where the config says so (OLMoE's clip_qkv)."""
        cfg = self.cfg
        t, d, eps = qkv.shape[0], cfg.head_dim, cfg.rms_norm_eps
        qd, kd = cfg.num_heads * d, cfg.num_kv_heads * d
        if lw.q_norm is not None:
            q, k = qkv[:, :qd], qkv[:, qd : qd + kd]
            if cfg.qk_norm_full:
                q, k = norm(q.contiguous(), lw.q_norm, eps), norm(k.contiguous(), lw.k_norm, eps)
            else:
                q = norm(q.reshape(-1, d), lw.q_norm, eps).reshape(t, qd)
                k = norm(k.reshape(-1, d), lw.k_norm, eps).reshape(t, kd)
            qkv = torch.cat([q, k, qkv[:, qd + kd :]], dim=1)
        if cfg.clip_qkv is not None:
            qkv = qkv.clamp(-cfg.clip_qkv, cfg.clip_qkv)
        return qkv

    def _attend(self, i: int, q: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        return paged_attention(q, caches[0], caches[1], meta, self.cfg.num_kv_heads, self.scale, self.attention_group,
                               window=self.windows[i], softcap=self.softcap,
                               wide_rows=self.prefill_attention.bf16_rows, int8_rows=self.prefill_attention.int8_rows,
                               int8_bf16_pv=self.prefill_attention.bf16_pv, int8_tiles=self.prefill_attention.amx,
                               int8_decode=self.prefill_attention.int8_decode,
                               lane_tokens=self.prefill_attention.lane_tokens,
                               spread_prefetch=self.prefill_attention.spread_prefetch)

    def _rope_and_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                        caches: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """PyTorch RoPE of q and k (full or partial), k and v written to their cache slots; returns q [T, H, D]."""
        cfg = self.cfg
        t, heads, kv_heads, d = qkv.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        split = (heads + kv_heads) * d
        qk = apply_rope(qkv[:, :split].reshape(t, heads + kv_heads, d), cos, sin)  # q and k heads rotated together
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, split:].reshape(t, kv_heads, d)
        k_cache, v_cache = caches
        flat_k = k_cache.view(-1, kv_heads, d)
        flat_v = v_cache.view(-1, kv_heads, d)
        flat_k.index_copy_(0, slots, k.to(flat_k.dtype))
        flat_v.index_copy_(0, slots, v.to(flat_v.dtype))
        return q

    def _rope_tables(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (cos, sin) rows for `positions`, looked up once per table."""
        looked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for rope in self.layer_ropes:
            if id(rope) not in looked:
                looked[id(rope)] = rope.lookup(positions)
        return [looked[id(rope)] for rope in self.layer_ropes]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T]. Returns the final-norm hidden states [T, hidden] (the residual stream
        before the final norm if returns_residual), or those of out_rows [R] only. With
        last_layer_sampled_rows and the C++ kernel's metadata, the last layer then writes every row's
        keys and values but runs attention, o_proj and the MLP for out_rows alone."""
        rows_meta = None  # the out rows' metadata where the last layer goes on with them alone
        if (out_rows is not None and self.last_layer_sampled_rows and self.ops is not None
                and meta.block_tables is not None and meta.kernel == "cpp" and not self.returns_residual
                and out_rows.numel() < input_ids.numel()):
            rows_meta = rows_metadata(meta, out_rows)
        if self.loop is not None and meta.block_tables is not None:
            rows = None if rows_meta is None else [out_rows, rows_meta.block_tables, rows_meta.query_start,
                                                   rows_meta.context_lens]
            hidden = self.loop.forward(input_ids, positions, meta.slot_mapping, meta.block_tables, meta.query_start,
                                       meta.context_lens, [k for k, _ in kv_caches], [v for _, v in kv_caches], rows)
        elif self.ops is not None:
            hidden = self._forward_fused(input_ids, positions, meta, kv_caches, out_rows, rows_meta)
        else:
            hidden = self._forward_plain(input_ids, positions, meta, kv_caches)
        return hidden if out_rows is None or rows_meta is not None else hidden[out_rows]

    def _forward_plain(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """forward() in PyTorch ops, every row through every layer."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        tables = self._rope_tables(positions)
        h = self._embed(input_ids)
        for i, (lw, caches) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x = rms_norm(h, lw.input_norm, eps)
            qkv = self._qk_norm(lw, lw.qkv_proj(x), rms_norm)
            q = self._rope_and_cache(qkv, *tables[i], meta.slot_mapping, caches)
            o = lw.o_proj(self._attend(i, q, caches, meta))
            if lw.attn_out_norm is not None:
                o = rms_norm(o, lw.attn_out_norm, eps)
            h = h + self._branch(o)
            m = self._mlp(lw, rms_norm(h, lw.post_norm, eps))
            if lw.mlp_out_norm is not None:
                m = rms_norm(m, lw.mlp_out_norm, eps)
            h = h + self._branch(m)
        return h if self.returns_residual else rms_norm(h, self.final_norm, eps)

    def _forward_fused(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        out_rows: torch.Tensor | None = None,
        rows_meta: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """forward() with the glue in C++: per layer 4 matmuls, attention and 4 small fused calls
        (a few more for the switches of Gemma and Granite; partial rotary rotates in PyTorch). rows_meta
        (out_rows' rows_metadata): the last layer goes on with those rows only, as the C++ loop."""
        cfg, ops = self.cfg, self.ops
        eps, heads, kv_heads, d = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        slots = meta.slot_mapping
        partial = cfg.rotary_dim not in (0, d)
        tables = self._rope_tables(positions) if partial else None
        h = self._embed(input_ids)  # the residual stream, updated in place by add_rms_norm
        x = ops.rms_norm(h, self.layers[0].input_norm, eps)
        last = len(self.layers) - 1
        for i, (lw, caches) in enumerate(zip(self.layers, kv_caches, strict=True)):
            qkv = _contiguous(lw.qkv_proj(x))
            if lw.q_norm is not None or cfg.clip_qkv is not None:
                qkv = self._qk_norm(lw, qkv, ops.rms_norm)
            if tables is not None:
                q = self._rope_and_cache(qkv, *tables[i], slots, caches)
            else:
                rope = self.layer_ropes[i]
                q = ops.rope_and_cache(qkv, rope.cos, rope.sin, positions, slots, caches[0], caches[1], heads, kv_heads)
            if rows_meta is not None and i == last:
                q, h, meta = q.index_select(0, out_rows), h.index_select(0, out_rows), rows_meta
            o = _contiguous(lw.o_proj(self._attend(i, q, caches, meta)))
            if lw.attn_out_norm is not None:
                o = ops.rms_norm(o, lw.attn_out_norm, eps)
            x = ops.add_rms_norm(h, self._branch(o), lw.post_norm, eps)
            down = _contiguous(self._mlp_fused(lw, x))
            if lw.mlp_out_norm is not None:
                down = ops.rms_norm(down, lw.mlp_out_norm, eps)
            norm = self.final_norm if i == last else self.layers[i + 1].input_norm
            x = ops.add_rms_norm(h, self._branch(down), norm, eps)
        return h if self.returns_residual else x

    def _mlp_fused(self, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        if lw.moe is not None or self.cfg.hidden_act != "silu":
            return self._mlp(lw, x)
        down = lw.down_proj
        # rows the down projection rounds (bfloat16 rows; with fast_silu any rounding layer) get the
        # vectorized SiLU, as the C++ loop does
        fast = ((getattr(down, "bf16_weight", None) is not None and x.shape[0] >= down.bf16_min_rows)
                or (self.fast_silu and bool(getattr(down, "rounds_activations", False))))
        return down(self.ops.silu_mul(_contiguous(lw.gate_up_proj(x)), fast))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab]: Granite divides them by logits_scaling, Gemma 2 soft-caps them."""
        return self._finish_logits(self.lm_head(hidden).float())

    def _finish_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Granite's divisor and Gemma 2's soft cap on float32 logits over the whole vocabulary."""
        cfg = self.cfg
        if cfg.logits_divisor != 1.0:
            out = out / cfg.logits_divisor
        if cfg.final_softcap:
            out = torch.tanh(out / cfg.final_softcap) * cfg.final_softcap
        return out


def prefill_attention(model: Decoder, config: Any) -> PrefillAttention:
    """The prefill attention paths for `model` under an EngineConfig. attention_bf16's auto turns it on
    where the projections took bfloat16 for wide calls too (quant_bf16_gemm) and attention_int8_scores
    is off; attention_int8_scores' auto turns it on for an int8 KV cache where the kernels have its
    AVX-512 VNNI path."""
    from hasten.kernels.cpu_features import (
        resolve_amx_attention,
        resolve_bf16_pv,
        resolve_bf16_rows,
        resolve_int8_attention_rows,
        resolve_int8_decode,
        resolve_lane_tiles,
    )

    bf16_gemm = getattr(model.layers[0].qkv_proj, "bf16_weight", None) is not None
    int8_rows = resolve_int8_attention_rows(config.attention_int8_scores, config.attention_int8_scores_min_rows,
                                            config.kv_cache_dtype == "int8")
    mode = config.attention_bf16
    if mode == "auto":  # the projections' own auto already asked for AMX; here it follows them, unless the
        # int8 cache's integer scores take those sequences (per 512-token step on a Sapphire Rapids class
        # CPU: 38-40 ms of attention against 62-72 ms for bfloat16 SDPA over the dequantized cache)
        mode = "on" if bf16_gemm and not int8_rows else "off"
    bf16_pv = resolve_bf16_pv(config.attention_bf16_pv, int8_rows)
    return PrefillAttention(
        bf16_rows=resolve_bf16_rows("attention_bf16", mode, config.attention_bf16_min_rows),
        int8_rows=int8_rows,
        bf16_pv=bf16_pv,
        amx=resolve_amx_attention(config.attention_amx, bf16_pv),
        int8_decode=resolve_int8_decode(config.attention_int8_decode, config.kv_cache_dtype == "int8"),
        lane_tokens=resolve_lane_tiles(config.attention_lane_tiles, config.attention_lane_tiles_min_tokens),
        spread_prefetch=bool(config.attention_spread_prefetch),
    )


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()
