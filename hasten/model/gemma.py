"""Gemma 2 and Gemma 3 (text, Gemma3ForCausalLM): what their configs switch on in the shared decoder.

Both: GeGLU MLP (gelu_pytorch_tanh gate), RMSNorm scaling by (1 + weight), RMSNorm on the attention
and MLP outputs too ("sandwich" norms: post_attention_layernorm / post_feedforward_layernorm, with
pre_feedforward_layernorm before the MLP), embeddings times sqrt(hidden_size), scores times
query_pre_attn_scalar ** -0.5, and sliding-window layers alternating with global ones.
Gemma 2 adds soft-capping of the attention scores and of the final logits; Gemma 3 adds RMSNorm on
each head of q and k, and its own RoPE theta (rope_local_base_freq) on the sliding-window layers.
"""

from __future__ import annotations

from typing import Any

from hasten.model.rope_params import rope_from_hf

GEMMA3_THETA = {"global": 1_000_000.0, "local": 10_000.0}  # transformers' defaults


def gemma_fields(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{family} with use_bidirectional_attention (an embedding model) is not supported")
    hidden = cfg["hidden_size"]
    fields: dict[str, Any] = dict(
        head_dim=cfg.get("head_dim") or 256,
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        norm_offset=1.0,
        sandwich_norms=True,
        embed_scale=hidden**0.5,
        attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )
    if family == "gemma2":
        fields["attn_softcap"] = cfg.get("attn_logit_softcapping", 50.0)
        fields["final_softcap"] = cfg.get("final_logit_softcapping", 30.0)
        return fields
    fields["attn_softcap"] = cfg.get("attn_logit_softcapping")
    fields["final_softcap"] = cfg.get("final_logit_softcapping")
    fields["qk_norm"] = True
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        # transformers >= 5: one RoPE dict per layer type
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        theta, scaling = rope_from_hf({"rope_theta": GEMMA3_THETA["global"]}, full)
        local_theta, local_scaling = rope_from_hf({"rope_theta": GEMMA3_THETA["local"]}, local)
    else:  # rope_theta (+ rope_scaling) for the global layers, rope_local_base_freq for the others
        theta, scaling = rope_from_hf({"rope_theta": GEMMA3_THETA["global"], **cfg})
        local_theta, local_scaling = float(cfg.get("rope_local_base_freq", GEMMA3_THETA["local"])), None
    fields.update(rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta,
                  local_rope_scaling=local_scaling)
    return fields
