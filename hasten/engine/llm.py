"""Offline API shaped like vLLM's: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from hasten.config import EngineConfig
from hasten.engine.engine import LLMEngine
from hasten.outputs import RequestOutput
from hasten.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Load a model once, then generate for many prompts with continuous batching.

    `model=None` loads the embedded default (SmolLM2-135M-Instruct). Every other keyword is
    an `EngineConfig` field (e.g. `dtype="bfloat16"`, `enable_prefix_caching=False`).
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", **options):
        self.engine = LLMEngine(EngineConfig.from_options(model=model, dtype=dtype, **options))
        self._ids = itertools.count()

    def close(self) -> None:
        """Release what the engine holds outside this process (tensor-parallel ranks)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The model's tokenizer (a transformers tokenizer), as vLLM's `LLM.get_tokenizer()`."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. `use_tqdm`: a progress bar (on stderr) as requests finish."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("need one SamplingParams per prompt (or a single one for all)")
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for i, (rid, prompt, p) in enumerate(zip(ids, prompts, params, strict=True)):
                self.engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0)
        except BaseException:  # an invalid prompt: none of this call's requests stay queued
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.engine.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool = False) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", unit="prompt", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[rid] for rid in ids]
