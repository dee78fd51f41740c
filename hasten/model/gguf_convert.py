"""A GGUF file as a Hugging Face folder: config.json from the GGUF's metadata, tensors renamed to HF
names (dequantized with the gguf package's own dequantizers) and the tokenizer, written once.

Each family as llama.cpp's convert_hf_to_gguf.py writes it, undone:
  llama (and Mixtral, llama with experts) and granite: q / k rows permuted for llama.cpp's RoPE -> un-permuted;
  gemma2 / gemma3: every RMSNorm weight stored as 1 + w -> w; the query scale (not in the file) by
    llama.cpp's rule, head_dim but hidden / heads for the 27B models; sliding layers every other
    one (gemma2) or five in six (gemma3), as llama.cpp sets them;
  phi3: fused attn_qkv and ffn_up (gate and up) as HF keeps them; LongRoPE factors from the
    rope_factors_long / _short tensors;
  granite: attention / embedding / residual / logit scales -> HF's multipliers;
  qwen3moe / olmoe / mixtral: experts stacked [E, N, K] -> one tensor per expert, router ffn_gate_inp.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from hasten.model.moe import EXPERT_NAMES

logger = logging.getLogger(__name__)

# llama.cpp's general.architecture -> the HF architecture a GGUF of it is converted to (llama with
# experts becomes Mixtral)
GGUF_ARCHS = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
}
_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe"}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma's four norms per layer: input, after attention, before and after the MLP
_GEMMA_NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# families whose q / k rows llama.cpp permutes for its RoPE (LlamaModel and its subclasses there)
ROPE_PERMUTED = ("llama", "mixtral", "granite")
_EXPERT_PARTS = {"ffn_gate_exps": 1, "ffn_up_exps": 2, "ffn_down_exps": 3}
_SKIPPED = ("rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight")


def unpermute_rope_rows(w: np.ndarray | torch.Tensor, n_heads: int) -> np.ndarray | torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF rotate-half halves); whole
    rows move, so it applies to weights and to per-row codes and scales alike (numpy or torch)."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_to_hf_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHS)}")
    p = f"{arch}."
    n_heads = int(_field(reader, p + "attention.head_count"))
    hidden = int(_field(reader, p + "embedding_length"))
    layers = int(_field(reader, p + "block_count"))
    names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    head_dim = int(_field(reader, p + "attention.key_length", hidden // n_heads))
    experts = int(_field(reader, p + "expert_count", 0) or 0)
    model_type = "mixtral" if arch == "llama" and experts else _MODEL_TYPES.get(arch, arch)
    cfg: dict[str, Any] = {
        "architectures": ["MixtralForCausalLM" if model_type == "mixtral" else GGUF_ARCHS[arch]],
        "model_type": model_type,
        "vocab_size": int(_field(reader, p + "vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, p + "context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        cfg["attention_bias"] = True
    if experts:
        cfg.update(num_local_experts=experts, num_experts=experts,
                   num_experts_per_tok=int(_field(reader, p + "expert_used_count")),
                   # llama.cpp renormalises the top-k weights for Mixtral and Qwen3-MoE, not for OLMoE
                   norm_topk_prob=arch != "olmoe")
        if _field(reader, p + "expert_feed_forward_length") is not None:
            cfg["moe_intermediate_size"] = int(_field(reader, p + "expert_feed_forward_length"))
    if arch in ("gemma2", "gemma3"):
        _gemma_config(reader, cfg, arch)
    elif arch == "phi3":
        _phi3_config(reader, cfg)
    elif arch == "granite":
        cfg.update(attention_multiplier=float(_field(reader, p + "attention.scale", 1 / math.sqrt(head_dim))),
                   embedding_multiplier=float(_field(reader, p + "embedding_scale", 1.0)),
                   residual_multiplier=float(_field(reader, p + "residual_scale", 1.0)),
                   logits_scaling=float(_field(reader, p + "logit_scale", 1.0)))
    return cfg


def _gemma_config(reader, cfg: dict, arch: str) -> None:
    p = f"{arch}."
    layers, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    big = layers == (46 if arch == "gemma2" else 62)  # the 27B models scale queries by hidden / heads
    pattern = 2 if arch == "gemma2" else int(_field(reader, p + "attention.sliding_window_pattern", 6) or 6)
    cfg.update(
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=hidden // heads if big else cfg["head_dim"],
        sliding_window=int(_field(reader, p + "attention.sliding_window", 4096)),
        layer_types=["sliding_attention" if i % pattern < pattern - 1 else "full_attention" for i in range(layers)],
        attn_logit_softcapping=_field(reader, p + "attn_logit_softcapping"),
        final_logit_softcapping=_field(reader, p + "final_logit_softcapping"),
    )
    if arch == "gemma3":
        full: dict[str, Any] = {"rope_theta": cfg.pop("rope_theta"), "rope_type": "default"}
        factor = _field(reader, p + "rope.scaling.factor")
        if _field(reader, p + "rope.scaling.type") == "linear" and factor:
            full.update(rope_type="linear", factor=float(factor))
        local = {"rope_theta": float(_field(reader, p + "rope.freq_base_swa", 10000.0)), "rope_type": "default"}
        cfg["rope_parameters"] = {"full_attention": full, "sliding_attention": local}


def _phi3_config(reader, cfg: dict) -> None:
    window = int(_field(reader, "phi3.attention.sliding_window", 0) or 0)
    dims = int(_field(reader, "phi3.rope.dimension_count", cfg["head_dim"]))
    cfg.update(sliding_window=window or None, partial_rotary_factor=dims / cfg["head_dim"],
               original_max_position_embeddings=int(_field(reader, "phi3.rope.scaling.original_context_length",
                                                           cfg["max_position_embeddings"])))
    tensors = {t.name: t for t in reader.tensors}
    if "rope_factors_long.weight" in tensors:
        def factors(name: str) -> list[float]:
            return [float(v) for v in np.asarray(tensors[name].data, dtype=np.float32).reshape(-1)]

        cfg["rope_scaling"] = {"type": "longrope", "long_factor": factors("rope_factors_long.weight"),
                               "short_factor": factors("rope_factors_short.weight")}


def gguf_tensor_name_to_hf(name: str, model_type: str = "llama") -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4:
        table = {**_LAYER_NAMES, **_GEMMA_NORMS} if model_type.startswith("gemma") else _LAYER_NAMES
        if model_type == "phi3" and parts[2] == "ffn_up":
            return f"model.layers.{parts[1]}.mlp.gate_up_proj.{parts[3]}"
        if parts[2] == "ffn_gate_inp" and model_type in EXPERT_NAMES:
            return f"model.layers.{parts[1]}.{EXPERT_NAMES[model_type][0]}gate.{parts[3]}"
        if parts[2] in table:
            return f"model.layers.{parts[1]}.{table[parts[2]]}.{parts[3]}"
    raise ValueError(f"unknown GGUF tensor {name!r}")


def hf_tensors(name: str, arr: np.ndarray, cfg: dict) -> dict[str, torch.Tensor]:
    """One GGUF tensor (dequantized, float32) as the HF tensors it stands for."""
    model_type = cfg["model_type"]
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _EXPERT_PARTS:
        prefix, *projs = EXPERT_NAMES[model_type]
        proj = projs[_EXPERT_PARTS[parts[2]] - 1]
        return {f"model.layers.{parts[1]}.{prefix}experts.{e}.{proj}.weight": torch.from_numpy(np.array(arr[e]))
                for e in range(arr.shape[0])}
    hf = gguf_tensor_name_to_hf(name, model_type)
    if model_type in ROPE_PERMUTED and hf.endswith(("q_proj.weight", "k_proj.weight")):
        heads = cfg["num_attention_heads"] if "q_proj" in hf else cfg["num_key_value_heads"]
        arr = unpermute_rope_rows(arr, heads)
    if model_type.startswith("gemma") and hf.endswith("norm.weight"):
        arr = arr - 1.0  # llama.cpp stores Gemma's (1 + w) norms as 1 + w
    return {hf: torch.from_numpy(np.array(arr, copy=True))}


def load_gguf_tokenizer(path: Path):
    """The GGUF's tokenizer through transformers; for a family transformers' GGUF loader does not know
    (granite, olmoe), through its tokenizer converters directly (the vocabulary does not depend on it)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except ValueError as e:
        if "not supported" not in str(e):
            raise
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

        arch, vocab, tok_config = get_gguf_tokenizer(str(path))
        fast, extra = convert_gguf_tokenizer(arch, vocab)
        return PreTrainedTokenizerFast(tokenizer_object=fast, **tok_config, **extra)


def is_converted(folder: Path) -> bool:
    """Whether `folder` holds a finished conversion (a folder is renamed into place only once whole)."""
    return (folder / "config.json").exists() and (folder / "model.safetensors").exists()


def convert_gguf_into(path: Path, out: Path) -> Path:
    """Dequantize `path` into the HF folder `out`: written into a folder of this process's own beside
    it, then renamed into place. Processes converting the same file at once (replicas starting on a
    fresh machine) each write their own copy; the first rename wins and the others drop theirs, so
    no process ever sees a folder another one is still writing or removing."""
    import tempfile

    from gguf import GGUFReader
    from gguf.quants import dequantize

    logger.info("converting %s into %s (once)", path, out)
    reader = GGUFReader(str(path))
    cfg = gguf_to_hf_config(reader)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp's folder is private; the cache keeps the usual permissions
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in _SKIPPED:
            continue
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        state.update(hf_tensors(t.name, arr, cfg))
    save_file(state, str(tmp / "model.safetensors"))
    tok = load_gguf_tokenizer(path)
    template = _field(reader, "tokenizer.chat_template")
    if template and not getattr(tok, "chat_template", None):
        tok.chat_template = template
    tok.save_pretrained(str(tmp))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    (tmp / "hasten_source.json").write_text(json.dumps({"gguf": str(path.resolve())}))
    for _ in range(2):
        try:
            tmp.rename(out)  # atomic; fails while `out` exists and is not empty
            return out
        except OSError:
            if is_converted(out):  # another process finished first: its folder stays
                shutil.rmtree(tmp, ignore_errors=True)
                return out
            # a partial folder left by a killed run: moved aside in one rename, then removed
            stale = Path(tempfile.mkdtemp(prefix=out.name + ".stale-", dir=out.parent))
            try:
                out.rename(stale / "old")
            except OSError:
                pass
            shutil.rmtree(stale, ignore_errors=True)
    raise OSError(f"could not move the converted model into {out}")
