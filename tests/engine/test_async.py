"""AsyncLLM: streaming deltas add up, concurrent requests, abort by closing the stream, errors."""

from __future__ import annotations

import asyncio

import pytest

from hasten import SamplingParams
from hasten.engine.async_engine import AsyncLLM, QueueFullError


def run(coro):
    return asyncio.run(coro)


def test_streaming_concurrent_abort_and_errors(tiny_models):
    async def main():
        llm = AsyncLLM.from_options(tiny_models("llama"), num_kv_blocks=128, max_model_len=512, max_waiting_requests=8)
        await llm.start()
        try:
            sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

            async def one(i):
                text, toks = "", []
                async for out in llm.generate([5 + i] * (3 + i), sp, f"r{i}"):
                    c = out.outputs[0]
                    text += c.delta_text
                    toks += c.delta_token_ids
                assert out.finished and c.finish_reason == "length"
                assert toks == c.token_ids and text == c.text
                assert out.metrics.ttft is not None and len(out.metrics.token_times) == 16
                return toks

            results = await asyncio.gather(*[one(i) for i in range(6)])
            # same answers as the offline engine path (greedy)
            solo = await one(0)
            assert solo == results[0]

            # abort by leaving the stream early: blocks come back within a step or two
            stream = llm.generate([7] * 40, sp.clone(max_tokens=400), "long")
            await stream.__anext__()
            await stream.aclose()
            for _ in range(50):
                await asyncio.sleep(0.02)
                st = llm.get_stats()
                if st.num_free_blocks == st.num_total_blocks and st.num_running == 0:
                    break
            st = llm.get_stats()
            assert st.num_free_blocks == st.num_total_blocks and st.num_running == 0

            with pytest.raises(ValueError, match="exceeds the context"):
                async for _ in llm.generate("hi", SamplingParams(max_tokens=10_000), "too-long"):
                    pass
            # the waiting-queue limit raises QueueFullError for the extra request only
            slow = SamplingParams(max_tokens=60, ignore_eos=True)
            gens = [llm.generate([9] * 30, slow, f"q{i}") for i in range(12)]
            outcomes = await asyncio.gather(*[_drain(g) for g in gens], return_exceptions=True)
            assert any(isinstance(o, QueueFullError) for o in outcomes)
            assert any(o == 60 for o in outcomes)
        finally:
            await llm.shutdown()

    run(main())


async def _drain(gen) -> int:
    n = 0
    async for out in gen:
        n = len(out.outputs[0].token_ids)
    return n
