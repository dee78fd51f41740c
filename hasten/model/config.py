"""One ModelConfig for every supported decoder, built from a HF config.json dict.

The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) is the base; the other families
(Gemma 2 / 3, Phi-3 / Phi-4, Granite, and the mixture-of-experts Mixtral, Qwen3-MoE and OLMoE) are
the same decoder with a few switches, read from their configs by hasten/model/gemma.py, phi3.py,
granite.py and moe.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hasten.model.gemma import gemma_fields
from hasten.model.granite import granite_fields
from hasten.model.moe import MOE_FAMILIES, moe_fields
from hasten.model.phi3 import phi3_fields, phi3_rope_config
from hasten.model.rope_params import RopeSpec, rope_from_hf

# HF architecture name -> family; the families the decoder serves
SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "GraniteForCausalLM": "granite",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}
# config.json "model_type" -> family, for configs without "architectures"
MODEL_TYPES = {
    "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
    "gemma3_text": "gemma3", "phi3": "phi3", "granite": "granite", "mixtral": "mixtral", "qwen3_moe": "qwen3_moe",
    "olmoe": "olmoe",
}
# family -> the models it covers (`hasten models`)
FAMILY_MODELS = {
    "llama": "Llama 2 / 3.x, SmolLM2 and other Llama-architecture models",
    "mistral": "Mistral (sliding_window on every layer when the config sets it)",
    "qwen2": "Qwen2, Qwen2.5 (sliding window with use_sliding_window)",
    "qwen3": "Qwen3 dense models (q/k norms)",
    "gemma2": "Gemma 2 (GeGLU, sandwich norms, soft-capping, alternating sliding-window layers)",
    "gemma3": "Gemma 3 text-only (q/k norms, local RoPE theta on the sliding-window layers)",
    "phi3": "Phi-3 / Phi-3.5-mini, Phi-4, Phi-4-mini (fused projections, partial rotary, LongRoPE)",
    "granite": "Granite 3.x dense (embedding / attention / residual / logits multipliers)",
    "mixtral": "Mixtral 8x7B / 8x22B (mixture of experts, top-2 of 8, renormalised)",
    "qwen3_moe": "Qwen3-MoE, e.g. Qwen3-30B-A3B (top-k of 128 experts, norm_topk_prob, mlp_only_layers)",
    "olmoe": "OLMoE (top-8 of 64 experts, q/k norms over the whole projection, clip_qkv)",
}
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


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
    qk_norm: bool = False  # RMSNorm on each head of q and k before RoPE (Qwen3, Gemma 3)
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # What sets the other families apart; the defaults are the Llama family's.
    hidden_act: str = "silu"  # MLP gate activation: silu | gelu_tanh (GeGLU, Gemma) | gelu
    mlp_bias: bool = False
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight): 1.0 for Gemma
    sandwich_norms: bool = False  # Gemma: RMSNorm on the attention and MLP outputs before each residual add
    embed_scale: float = 1.0  # embeddings times this: sqrt(hidden) for Gemma, embedding_multiplier for Granite
    residual_scale: float = 1.0  # Granite's residual_multiplier on each branch before its residual add
    attn_scale: float | None = None  # scores times this; None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    logits_divisor: float = 1.0  # Granite's logits_scaling
    rotary_dim: int = 0  # dims of each head RoPE rotates (partial rotary); 0: all of them
    layer_windows: list[int] = field(default_factory=list)  # per layer: sliding window (0: every key); [] none
    local_rope_theta: float | None = None  # Gemma 3: RoPE theta of the sliding-window layers
    local_rope_scaling: dict[str, Any] | None = None
    # Mixture of experts (hasten/model/moe.py); num_experts 0: dense MLPs everywhere
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    moe_layers: list[bool] = field(default_factory=list)  # per layer: True where the MLP is a MoE block
    qk_norm_full: bool = False  # OLMoE: the q / k norms span the whole projection, not one head
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to [-clip, clip] after the norms

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        family = family_of(cfg)
        if family == "phi3":
            cfg = phi3_rope_config(cfg)
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        rope_theta, rope_scaling = rope_from_hf(cfg)
        fields: dict[str, Any] = dict(
            arch=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            rope_scaling=rope_scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=cfg.get("hidden_act", "silu"),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
        )
        if family in ("gemma2", "gemma3"):
            fields.update(gemma_fields(cfg, family))
        elif family == "phi3":
            fields.update(phi3_fields(cfg, fields["head_dim"]))
        elif family == "granite":
            fields.update(granite_fields(cfg))
        elif family in MOE_FAMILIES:
            fields.update(moe_fields(cfg, family, fields["num_layers"]))
        fields["hidden_act"] = activation(fields["hidden_act"])
        fields["layer_windows"] = layer_windows(cfg, family, fields["num_layers"])
        return cls(**fields)

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    def linear_names(self) -> list[str]:
        """The names the decoder gives its projections when it asks a LinearFactory for them."""
        names = []
        for i in range(self.num_layers):
            names += [f"layers.{i}.qkv_proj", f"layers.{i}.o_proj"]
            if self.is_moe(i):
                names += [f"layers.{i}.experts.{e}.{p}" for e in range(self.num_experts)
                          for p in ("gate_up_proj", "down_proj")]
            else:
                names += [f"layers.{i}.gate_up_proj", f"layers.{i}.down_proj"]
        return names

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (0: the layer attends to every earlier key)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def windows_within(self, max_len: int) -> list[int]:
        """Every layer's window, 0 where it covers max_len anyway (so it changes nothing)."""
        return [w if 0 < w < max_len else 0 for w in (self.window(i) for i in range(self.num_layers))]

    def rope_spec(self, local: bool = False) -> RopeSpec:
        """The RoPE of the global layers, or (local=True, Gemma 3) of the sliding-window layers."""
        rd = self.rotary_dim or self.head_dim
        if local and self.local_rope_theta is not None:
            return RopeSpec(self.local_rope_theta, rd, self.local_rope_scaling, self.max_position_embeddings)
        return RopeSpec(self.rope_theta, rd, self.rope_scaling, self.max_position_embeddings)

    def uses_local_rope(self, layer: int) -> bool:
        return self.local_rope_theta is not None and self.window(layer) > 0


def family_of(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    family = next((SUPPORTED_ARCHS[a] for a in archs if a in SUPPORTED_ARCHS), None)
    if family is None:
        family = MODEL_TYPES.get(cfg.get("model_type", ""))
    if family is None:
        name = ", ".join(archs) if archs else f"model_type {cfg.get('model_type')!r}"
        raise ValueError(f"unsupported model architecture {name}; supported: {', '.join(SUPPORTED_ARCHS)}")
    return family


def activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported MLP activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def layer_windows(cfg: dict[str, Any], family: str, num_layers: int) -> list[int]:
    """Each layer's sliding window: `sliding_window` on the layers `layer_types` marks
    "sliding_attention", or the family's default pattern (Gemma 2: every other layer starting with
    the first; Gemma 3: all but every `sliding_window_pattern`-th; Qwen2/3: the layers from
    max_window_layers on, only with use_sliding_window; Mistral, Phi-3 and others: every layer)."""
    window = cfg.get("sliding_window")
    if family in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False):
        window = None
    if not window:
        return []
    types = cfg.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"unsupported layer types {sorted(unknown)}")
        sliding = [t == "sliding_attention" for t in types]
    elif family == "gemma2":
        sliding = [(i + 1) % 2 != 0 for i in range(num_layers)]
    elif family == "gemma3":
        pattern = int(cfg.get("sliding_window_pattern", 6))
        sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    elif family in ("qwen2", "qwen3", "qwen3_moe"):
        first = int(cfg.get("max_window_layers", num_layers))
        sliding = [i >= first for i in range(num_layers)]
    else:
        sliding = [True] * num_layers
    return [int(window) if s else 0 for s in sliding]
