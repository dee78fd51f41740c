"""`hasten serve --task embed`: the /v1/embeddings endpoint and the engine behind it.

`EmbedEngine` wraps a sentence encoder (hasten/model/embedding.py: mean pooling + L2
normalisation) with the lifecycle the server expects of an engine (`start`, `shutdown`,
`model_name`, `max_model_len`). `EmbedServing` answers requests: the inputs of one request
are tokenized and encoded as one batch in a worker thread (the event loop never waits on
the model; concurrent requests take turns on it), and the response has OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from hasten.server.errors import APIError
from hasten.server.protocol import EmbeddingRequest

logger = logging.getLogger("hasten.server")

EMBED_OPTIONS = {"num_threads"}  # the engine options an embedding model takes


class EmbedEngine:
    task = "embed"
    errored: BaseException | None = None

    def __init__(self, model: str | None = None, num_threads: int | None = None) -> None:
        from hasten.model.embedding import SentenceEncoder, resolve_model_dir

        path, self.model_name = resolve_model_dir(model)
        self.encoder = SentenceEncoder(path, num_threads)
        self.tokenizer = self.encoder.tokenizer
        self.dim = self.encoder.dim
        self.max_model_len = self.encoder.max_length

    @classmethod
    def from_options(cls, model: str | None, **options: Any) -> EmbedEngine:
        unknown = sorted(set(options) - EMBED_OPTIONS)
        if unknown:
            raise ValueError(f"option(s) {', '.join(unknown)} do not apply to an embedding model "
                             f"(it takes: {', '.join(sorted(EMBED_OPTIONS))})")
        return cls(model, **options)

    async def start(self) -> None:
        await asyncio.to_thread(self.encoder.embed, ["warm-up"])

    async def shutdown(self) -> None:
        return None


def _encode_vector(vec: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
    return vec.tolist()


class EmbedServing:
    def __init__(self, engine: EmbedEngine, served_names: list[str]) -> None:
        self.engine = engine
        self.model_name = served_names[0]
        self.served_names = set(served_names)
        self.max_model_len = engine.max_model_len
        self.vocab_limit = len(engine.tokenizer)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_names:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def _token_ids(self, body: EmbeddingRequest) -> list[list[int]]:
        """Each input as token ids, truncated if asked, checked against the model's maximum length."""
        limit = body.truncate_prompt_tokens
        if limit == -1:
            limit = self.max_model_len
        if limit is not None and not 1 <= limit <= self.max_model_len:
            raise APIError(400, f"truncate_prompt_tokens must be -1 or between 1 and the model's maximum "
                                f"length {self.max_model_len}, got {limit}.", param="truncate_prompt_tokens")
        raw = body.input
        if isinstance(raw, str) or (raw and isinstance(raw[0], str)):
            texts: Sequence[str] = [raw] if isinstance(raw, str) else raw  # type: ignore[assignment]
            enc = self.engine.tokenizer(list(texts), add_special_tokens=body.add_special_tokens,
                                        truncation=limit is not None, max_length=limit)
            ids = [list(seq) for seq in enc["input_ids"]]
        else:
            ids = [raw] if isinstance(raw[0], int) else list(raw)  # type: ignore[list-item]
            for seq in ids:
                for t in seq:
                    if t >= self.vocab_limit:
                        raise APIError(400, f"token id {t} is out of range (vocabulary size {self.vocab_limit})",
                                       param="input")
            if limit is not None:
                ids = [seq[-limit:] for seq in ids]
        for i, seq in enumerate(ids):
            if len(seq) > self.max_model_len:
                raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. "
                                    f"However, input {i} has {len(seq)} tokens. Shorten it, or set "
                                    f"`truncate_prompt_tokens` to truncate it.", param="input",
                               code="context_length_exceeded")
            if not seq:
                raise APIError(400, f"input {i} has no tokens.", param="input")
        return ids

    def _compute(self, body: EmbeddingRequest) -> tuple[np.ndarray, int]:
        ids = self._token_ids(body)
        return self.engine.encoder.embed_ids(ids), sum(len(seq) for seq in ids)

    async def create(self, body: EmbeddingRequest) -> dict[str, Any]:
        self.check_model(body.model)
        if body.dimensions is not None and body.dimensions != self.engine.dim:
            raise APIError(400, f"The model `{self.model_name}` does not support `dimensions` other than its "
                                f"size {self.engine.dim} (it is not a Matryoshka model).", param="dimensions")
        t0 = time.perf_counter()
        vectors, tokens = await asyncio.to_thread(self._compute, body)
        logger.info("embedded %d input(s), %d tokens in %.1f ms", len(vectors), tokens,
                    (time.perf_counter() - t0) * 1000)
        data = [{"object": "embedding", "index": i, "embedding": _encode_vector(vec, body.encoding_format)}
                for i, vec in enumerate(vectors)]
        return {"object": "list", "data": data, "model": self.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
