"""One ModelConfig for every supported decoder, built from a HF config.json dict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head of q and k before RoPE (Qwen3)
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        family = next((SUPPORTED_ARCHS[a] for a in archs if a in SUPPORTED_ARCHS), None)
        if family is None:
            family = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}.get(
                cfg.get("model_type", "")
            )
        if family is None:
            raise ValueError(
                f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHS)}"
            )
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")  # transformers >= 5 folds theta and scaling in here
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if kind not in ("default", "llama3", "linear"):
                raise ValueError(f"unsupported rope scaling {kind!r}")
            if kind == "default":
                rope_scaling = None
        return cls(
            arch=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
            qk_norm=family == "qwen3",
            rope_scaling=rope_scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
