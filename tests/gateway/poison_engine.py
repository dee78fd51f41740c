"""`hasten serve --engine-factory tests.gateway.poison_engine:make`: the real engine (thread mode) with a
simulated sampler bug that any request with ``seed == POISON_SEED`` trips, for poison-request tests."""

from __future__ import annotations

from typing import Any

from hasten.engine.async_engine import AsyncLLM

POISON_SEED = 424242


def make(model: str | None = None, **options: Any) -> AsyncLLM:
    llm = AsyncLLM.from_options(model, **options)
    sampler = llm.engine.sampler
    real_sample = sampler.sample

    def sample(logits, reqs):  # type: ignore[no-untyped-def]
        if any(r.params.seed == POISON_SEED for r in reqs):
            raise IndexError("simulated sampler bug tripped by the poison seed")
        return real_sample(logits, reqs)

    sampler.sample = sample  # type: ignore[method-assign]
    return llm
