"""Hands a Decoder's weights to the C++ layer loop (DecoderLoop in hasten/kernels/decoder_loop_cpu.cpp).

The loop makes the same kernel calls as Decoder._forward_fused, so it needs the fused C++ ops, the
in-place attention kernel (flat metadata) and float32 activations. Each projection runs natively
when its layout is one the loop knows (float32 dense or tiled, hasten's int4 / int8 / grouped int8 kernels,
each with its bfloat16 or 8-bit copy for wide calls when enable_bf16_gemm / enable_u8_gemm gave it one);
any other layer (oneDNN's packed weights, aten's int4pack, ...) is called back in Python.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from hasten.model.linear import DenseLinear, TiledLinear

# The model passed in is a hasten.model.decoder.Decoder (which imports this module when it builds its
# loop); it is typed `Any` here so that the two modules do not import each other.


def native_linear(mod: ModuleType, layer: Any) -> Any:
    """The loop's Linear for one projection (a Python call-back when no native path fits)."""
    from hasten.quant.kernels import GroupedInt8Linear, Int4HastenLinear, Int8Linear

    if isinstance(layer, TiledLinear):
        return mod.make_linear("tiled", [layer.weight], bias=layer.bias)
    if type(layer) is DenseLinear and layer.weight.dtype == torch.float32:
        return mod.make_linear("dense", [layer.weight], bias=layer.bias)
    wide = ({"bf16_weight": layer.bf16_weight, "bf16_min_rows": layer.bf16_min_rows,
             "bf16_stream": bool(getattr(layer, "bf16_stream", True))}
            if getattr(layer, "bf16_weight", None) is not None else {})
    wide["rounds_input"] = bool(getattr(layer, "rounds_activations", False))
    if getattr(layer, "u8_weight", None) is not None:
        wide.update(u8_weight=list(layer.u8_weight), u8_min_rows=layer.u8_min_rows, u8_x_runs=layer.u8_x_runs,
                    u8_pow2_x_scales=layer.u8_pow2_x_scales)
    if hasattr(layer, "n"):
        wide["out_features"] = layer.n
    if isinstance(layer, Int4HastenLinear):
        kind = "int4_q8" if layer.int8_activations else "int4"
        tensors = [layer.codes, layer.scales, layer.mins] + (list(layer.rows8) if layer.rows8 is not None else [])
        return mod.make_linear(kind, tensors, layer.group_size, layer.bias,
                               layer.inv_input_scale, gemm_min_rows=layer.gemm_min_rows, **wide)
    if isinstance(layer, GroupedInt8Linear) and layer.rows8 is not None:
        return mod.make_linear("int8g", list(layer.rows8), layer.group_size, layer.bias, layer.inv_input_scale, **wide)
    if isinstance(layer, Int8Linear) and layer.kernel == "hasten":
        return mod.make_linear("int8", [layer.qweight, layer.scales], 0, layer.bias, layer.inv_input_scale, **wide)
    return mod.make_linear("python", [], callable=layer, **wide)


def loop_covers(model: Any) -> bool:
    """Whether the loop computes this model's layers: the Llama family's layer (q/k norms, biases and
    a per-layer sliding window included) with one full-width RoPE table. Not (the Python loop runs
    them): GeGLU, sandwich norms, embedding / residual multipliers, attention soft-capping, partial
    rotary, per-layer RoPE tables (Gemma 2 / 3, Granite, Phi-4-mini), mixtures of experts, OLMoE's
    whole-projection q/k norms and clip_qkv."""
    cfg = model.cfg
    return (cfg.hidden_act == "silu" and not cfg.num_experts and not cfg.qk_norm_full and cfg.clip_qkv is None and not cfg.sandwich_norms and model.embed_scale is None
            and cfg.residual_scale == 1.0 and not model.softcap and cfg.rotary_dim in (0, cfg.head_dim)
            and all(rope is model.rope for rope in model.layer_ropes))


def build_decoder_loop(model: Any) -> Any | None:
    """A DecoderLoop over `model`'s weights, or None when the loop cannot run this model (kernels
    unavailable, activations other than float32, or a layer the loop does not cover)."""
    if model.ops is None or model.dtype != torch.float32 or not loop_covers(model):
        return None
    from hasten.kernels import quant_linear

    mod = quant_linear.load()
    if mod is None:
        return None
    cfg = model.cfg
    loop = mod.DecoderLoop(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, model.scale,
                           model.embed, model.final_norm, model.rope.cos, model.rope.sin)
    for lw, window in zip(model.layers, model.windows, strict=True):
        loop.add_layer(lw.input_norm, lw.post_norm, lw.q_norm, lw.k_norm, native_linear(mod, lw.qkv_proj),
                       native_linear(mod, lw.o_proj), native_linear(mod, lw.gate_up_proj),
                       native_linear(mod, lw.down_proj), window)
    return loop
