"""Phi-3 / Phi-4 (Phi3ForCausalLM): fused qkv_proj and gate_up_proj in the checkpoint (the decoder's
own fused layout, loaded as they are), partial rotary (partial_rotary_factor), LongRoPE scaling.

LongRoPE ("longrope", or the older names "su" / "yarn" that transformers maps to it for Phi-3)
rescales each RoPE frequency by a short or a long factor and multiplies cos / sin by an attention
factor (sqrt(1 + ln(s) / ln(original_max_position_embeddings)), s = max_position_embeddings /
original_max_position_embeddings, unless the config gives one); see hasten/model/rope.py for which
set of factors the engine uses.
"""

from __future__ import annotations

from typing import Any


def phi3_rope_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A copy of `cfg` whose RoPE scaling dict is normalized: type "longrope", with
    original_max_position_embeddings (the top-level value wins, as in transformers)."""
    out = dict(cfg)
    for key in ("rope_parameters", "rope_scaling"):
        scaling = cfg.get(key)
        if not isinstance(scaling, dict):
            continue
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind in ("su", "yarn", "longrope"):
            scaling = {**scaling, "rope_type": "longrope"}
            scaling.pop("type", None)
            original = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
            scaling["original_max_position_embeddings"] = int(original or cfg.get("max_position_embeddings", 4096))
            out[key] = scaling
    return out


def phi3_fields(cfg: dict[str, Any], head_dim: int) -> dict[str, Any]:
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    factor = float(cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"partial_rotary_factor {factor} gives {rotary_dim} rotary dims of {head_dim}")
    scaling = cfg.get("rope_scaling") or params
    if scaling and scaling.get("rope_type") == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(scaling.get(key) or []) != rotary_dim // 2:
                raise ValueError(f"longrope {key} must have {rotary_dim // 2} entries (rotary dims / 2)")
    return dict(rotary_dim=0 if rotary_dim == head_dim else rotary_dim)
