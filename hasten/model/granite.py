"""Granite (GraniteForCausalLM): the Llama decoder with four multipliers from its config."""

from __future__ import annotations

from typing import Any


def granite_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(
        embed_scale=float(cfg.get("embedding_multiplier", 1.0)),  # embeddings times this
        attn_scale=float(cfg.get("attention_multiplier", 1.0)),  # replaces head_dim ** -0.5
        residual_scale=float(cfg.get("residual_multiplier", 1.0)),  # each branch times this before its add
        logits_divisor=float(cfg.get("logits_scaling", 1.0)),  # logits divided by this
    )
