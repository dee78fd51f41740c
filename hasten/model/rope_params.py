"""RoPE parameters as configs state them (no torch here: hasten/model/rope.py builds the tables)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True)
class RopeSpec:
    """One rotary table's parameters: theta, scaling (None = plain RoPE) and rotated dims."""

    theta: float
    rotary_dim: int
    scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096  # the config's: LongRoPE derives its attention factor from it


def rope_kind(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


def check_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """None for plain RoPE; the dict itself for a supported scaling type; ValueError otherwise."""
    kind = rope_kind(scaling)
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling {kind!r}; supported: {', '.join(ROPE_TYPES)}")
    return None if kind == "default" else scaling


def rope_from_hf(cfg: dict[str, Any], params: dict[str, Any] | None = None) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from a config's rope_theta / rope_scaling, or transformers >= 5's
    rope_parameters (which folds both in); `params` stands in for the rope_parameters dict."""
    rope_theta = cfg.get("rope_theta")
    rope_scaling = cfg.get("rope_scaling")
    rope_params = cfg.get("rope_parameters") if params is None else params
    if isinstance(rope_params, dict):
        rope_theta = rope_params.get("rope_theta", rope_theta)
        if rope_kind(rope_params) != "default":
            rope_scaling = rope_params
    return float(rope_theta if rope_theta is not None else 10000.0), check_rope_scaling(rope_scaling)
