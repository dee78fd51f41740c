"""decode_defer_ms: while prompts wait or are part-way through prefill, a decoding request whose last
token is recent sits a step out; never when nothing else could run, never past the interval."""

from __future__ import annotations

import time

import pytest

from hasten import SamplingParams
from hasten.engine.kv_cache import KVCacheManager
from hasten.engine.request import Request
from hasten.engine.scheduler import Scheduler, SchedulerConfig


def _request(rid: str, prompt_len: int) -> Request:
    return Request(rid, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=8), [0])


def _decoding(sched: Scheduler, rid: str, last_token_ago_s: float) -> Request:
    """A running request with its prompt computed and one generated token to feed."""
    req = _request(rid, 8)
    sched.add(req)
    batch = sched.schedule()
    assert batch.requests == [req]
    req.num_computed_tokens = 8
    req.output_token_ids.append(5)
    req.metrics.last_token_time = time.time() - last_token_ago_s
    return req


def _scheduler(defer_ms: float, max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, decode_defer_ms=defer_ms)
    return Scheduler(cfg, KVCacheManager(num_blocks=64, block_size=4))


def test_a_recent_decode_sits_out_while_a_prompt_waits():
    sched = _scheduler(defer_ms=500)
    dec = _decoding(sched, "a", last_token_ago_s=0.01)
    new = _request("b", 20)
    sched.add(new)
    batch = sched.schedule()
    assert batch.requests == [new] and batch.num_new_tokens == [20]
    assert dec in sched.running  # only skipped, not preempted


def test_a_prompt_part_way_through_prefill_also_holds_decodes_back():
    sched = _scheduler(defer_ms=500, budget=16)
    dec = _decoding(sched, "a", last_token_ago_s=0.01)
    long = _request("b", 40)
    sched.add(long)
    assert sched.schedule().requests == [long]  # 16 of its 40 tokens
    long.num_computed_tokens = 16
    dec.metrics.last_token_time = time.time()
    assert sched.schedule().requests == [long]
    dec.metrics.last_token_time = time.time() - 1.0  # waited longer than the interval: it runs
    long.num_computed_tokens = 32
    batch = sched.schedule()
    assert batch.requests == [dec, long] and batch.num_new_tokens == [1, 8]


def test_decodes_run_when_nothing_waits_or_nothing_can_be_admitted():
    sched = _scheduler(defer_ms=500)
    dec = _decoding(sched, "a", last_token_ago_s=0.0)
    assert sched.schedule().requests == [dec]  # no prompt waiting
    full = _scheduler(defer_ms=500, max_num_seqs=1)
    only = _decoding(full, "a", last_token_ago_s=0.0)
    full.add(_request("b", 20))  # cannot be admitted: max_num_seqs reached
    assert full.schedule().requests == [only]


def test_off_by_default_and_checked():
    sched = _scheduler(defer_ms=0)
    dec = _decoding(sched, "a", last_token_ago_s=0.0)
    new = _request("b", 20)
    sched.add(new)
    assert sched.schedule().requests == [dec, new]
    for bad in (-1, float("inf"), float("nan"), "5", True, None):
        with pytest.raises(ValueError, match="decode_defer_ms must be a number >= 0"):
            SchedulerConfig(decode_defer_ms=bad)


def test_engine_tokens_are_the_same_with_deferral(tiny_models):
    """Deferral only reorders work between steps: greedy tokens are unchanged."""
    from hasten import LLM
    from tests.engine.conftest import random_prompts

    path = tiny_models("llama")
    prompts = random_prompts(6, 256, seed=7, min_len=20, max_len=90)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = []
    for defer in (0, 10_000):
        llm = LLM(path, num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=32, decode_defer_ms=defer)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1]
