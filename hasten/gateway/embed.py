"""Sentence embeddings for the gateway (semantic cache, cascade, prompt compression).

The packaged all-MiniLM-L6-v2, loaded lazily and offline through
hasten/model/embedding.py (mean pooling + L2 normalisation, the sentence-transformers
recipe), the same code `hasten serve --task embed` serves. torch is imported only on the
first call, so a gateway without semantic cache, cascade or prompt compression never
imports it.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence

import numpy as np

from hasten.model.embedding import SentenceEncoder


class Embedder:
    dim = 384

    def __init__(self, model_dir: str | None = None, max_length: int = 256, batch: int = 64) -> None:
        self._dir = model_dir
        self._max_length = max_length
        self._batch = batch
        self._lock = threading.Lock()
        self._encoder: SentenceEncoder | None = None

    def _get(self) -> SentenceEncoder:
        with self._lock:
            if self._encoder is None:
                # one intra-op thread: a short sentence gains nothing from more, and on a busy machine
                # extra threads contend (measured on 2 shared cores: 25 ms with 1 thread, >300 ms with 2)
                self._encoder = SentenceEncoder(self._dir, int(os.environ.get("HASTEN_EMBED_THREADS", "1")))
            return self._encoder

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit vectors, one row per text (blocking; use :meth:`aembed` from the event loop)."""
        encoder = self._get()
        if not texts:
            return np.zeros((0, encoder.dim), dtype=np.float32)
        ids = encoder.tokenize(texts, min(self._max_length, encoder.max_length))
        return encoder.embed_ids(ids, self._batch)

    async def aembed(self, texts: Sequence[str]) -> np.ndarray:
        return await asyncio.to_thread(self.embed, texts)


_shared: Embedder | None = None


def shared_embedder() -> Embedder:
    """One model per process."""
    global _shared
    if _shared is None:
        _shared = Embedder()
    return _shared
