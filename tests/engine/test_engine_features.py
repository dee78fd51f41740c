"""Prefix caching, chunked prefill, preemption, sampling, stops and aborts on the tiny Llama."""

from __future__ import annotations

import pytest

from hasten import LLM, SamplingParams
from tests.engine.conftest import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_llm):
    return random_prompts(16, tiny_llm.engine.model_config.vocab_size, seed=11, max_len=200)


@pytest.fixture(scope="module")
def reference(tiny_models, prompts):
    """Greedy outputs with every optimisation that could change them switched off."""
    llm = LLM(
        tiny_models("llama"), num_kv_blocks=1024, max_model_len=1024, enable_prefix_caching=False,
        enable_chunked_prefill=False, max_num_batched_tokens=1024,
    )
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("budget", [16, 64, 512])
def test_chunked_prefill_budgets_give_identical_outputs(tiny_models, prompts, reference, budget):
    llm = LLM(tiny_models("llama"), num_kv_blocks=1024, max_model_len=1024, max_num_batched_tokens=budget)
    assert tokens(llm.generate(prompts, GREEDY)) == reference


def test_prefix_cache_hits_give_identical_outputs(tiny_models, prompts, reference):
    llm = LLM(tiny_models("llama"), num_kv_blocks=1024, max_model_len=1024, max_num_batched_tokens=256)
    assert tokens(llm.generate(prompts, GREEDY)) == reference
    stats0 = llm.engine.get_stats()
    # Same prompts again: every full block of each prompt is now cached.
    outs = llm.generate(prompts, GREEDY)
    assert tokens(outs) == reference
    stats1 = llm.engine.get_stats()
    hits = stats1.prefix_cache_hits - stats0.prefix_cache_hits
    expected = sum(((len(p) - 1) // 16) * 16 for p in prompts)
    assert hits == expected > 0
    assert sum(o.num_cached_tokens for o in outs) == expected
    assert stats1.prefix_cache_queries - stats0.prefix_cache_queries == sum(len(p) for p in prompts)


def test_shared_prefix_is_computed_once(tiny_models):
    llm = LLM(tiny_models("llama"), num_kv_blocks=256, max_model_len=1024)
    system = random_prompts(1, 300, seed=2, min_len=100, max_len=101)[0]
    first = llm.generate([system + [5, 6, 7]], GREEDY)[0]
    second = llm.generate([system + [8, 9]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 96  # 6 full blocks of the 100-token shared prefix


def test_prefix_groups_in_attention_change_nothing(tiny_models):
    """Decode sequences that share cached system-prompt blocks are grouped in the attention kernel
    (attention_prefix_group); tokens and logprobs are the same as without grouping or caching."""
    systems = random_prompts(3, 300, seed=5, min_len=70, max_len=90)
    prompts = [systems[i % 3] + [10 + i, 20 + i] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    results = []
    for options in ({"attention_prefix_group": 8}, {"attention_prefix_group": 1}, {"enable_prefix_caching": False}):
        llm = LLM(tiny_models("llama"), num_kv_blocks=512, max_model_len=1024, **options)
        llm.generate(systems, SamplingParams(temperature=0, max_tokens=1))  # the system prompts are cached now
        outs = llm.generate(prompts, params)
        results.append(([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs],
                        sum(o.num_cached_tokens for o in outs)))
    grouped, alone, uncached = results
    assert grouped[2] == alone[2] > 0 and uncached[2] == 0
    assert grouped[:2] == alone[:2]  # bit-identical
    assert grouped[0] == uncached[0]


def test_cache_salt_keeps_tenants_apart(tiny_models):
    llm = LLM(tiny_models("llama"), num_kv_blocks=256, max_model_len=1024)
    prompt = random_prompts(1, 300, seed=4, min_len=64, max_len=65)[0]
    eng = llm.engine
    for rid, salt in [("a1", "tenant-a"), ("b1", "tenant-b"), ("a2", "tenant-a")]:
        eng.add_request(rid, prompt, GREEDY, cache_salt=salt)
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    cached = out.num_cached_tokens
        assert cached == (48 if rid == "a2" else 0), rid


def test_preemption_gives_identical_outputs(tiny_models, prompts, reference):
    # 40 blocks of 16 tokens cannot hold 16 sequences of up to ~220 tokens: preemption must happen.
    llm = LLM(tiny_models("llama"), num_kv_blocks=40, max_model_len=512, max_num_batched_tokens=128)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.get_stats().num_preemptions > 0
    assert tokens(outs) == reference
    assert llm.engine.kv.num_free_blocks == 40


def test_priority_policy_runs_urgent_requests_first(tiny_models):
    llm = LLM(tiny_models("llama"), num_kv_blocks=256, max_model_len=512, max_num_seqs=1,
              scheduling_policy="priority")
    ps = random_prompts(3, 300, seed=8, min_len=10, max_len=11)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), priority=[5, 0, 1])
    order = sorted(range(3), key=lambda i: outs[i].metrics.first_token_time)
    assert order == [1, 2, 0]


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_llm, prompts):
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    alone = tiny_llm.generate([prompts[0]], sp)[0].outputs[0].token_ids
    noisy = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    batch = tiny_llm.generate(prompts[:6], [sp] + [noisy] * 5)[0].outputs[0].token_ids
    assert alone == batch
    other = tiny_llm.generate([prompts[0]], sp.clone(seed=99))[0].outputs[0].token_ids
    assert other != alone


def test_n_sequences(tiny_llm, prompts):
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    out = tiny_llm.generate([prompts[1]], sp)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = tiny_llm.generate([prompts[1]], sp)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_max_tokens_and_stop_token_ids(tiny_llm, prompts):
    base = tiny_llm.generate([prompts[2]], GREEDY)[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 24
    stop_tok = base.token_ids[5]
    first = base.token_ids.index(stop_tok)
    out = tiny_llm.generate([prompts[2]], GREEDY.clone(stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == base.token_ids[: first + 1]


def test_eos_stops_unless_ignored(tiny_llm, prompts):
    eos = tiny_llm.engine.eos_token_ids[0]
    # Force EOS to be the most likely token with a huge logit bias through a processor.
    def force_eos(_ids, logits):
        logits[eos] += 1e4

    out = tiny_llm.generate([prompts[3]], SamplingParams(temperature=0, max_tokens=5, logits_processors=[force_eos]))[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids == [eos]
    out = tiny_llm.generate(
        [prompts[3]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logits_processors=[force_eos])
    )[0]
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].token_ids == [eos] * 5
    out = tiny_llm.generate(
        [prompts[3]], SamplingParams(temperature=0, max_tokens=5, min_tokens=3, logits_processors=[force_eos])
    )[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].token_ids[-1] == eos


def test_stop_strings_across_token_boundaries(tiny_llm, prompts):
    tok = tiny_llm.tokenizer
    base = tiny_llm.generate([prompts[4]], GREEDY.clone(max_tokens=40))[0].outputs[0]
    text = base.text
    # A stop string that straddles the boundary between two tokens.
    pieces = [tok.decode(base.token_ids[:i]) for i in range(len(base.token_ids) + 1)]
    cut = next(i for i in range(3, len(pieces)) if len(pieces[i]) > len(pieces[i - 1]) + 1 and len(pieces[i - 1]) >= 2)
    stop = text[len(pieces[cut - 1]) - 1 : len(pieces[cut - 1]) + 1]
    out = tiny_llm.generate([prompts[4]], GREEDY.clone(max_tokens=40, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.find(stop)]
    assert stop not in out.text
    incl = tiny_llm.generate([prompts[4]], GREEDY.clone(max_tokens=40, stop=[stop], include_stop_str_in_output=True))
    assert incl[0].outputs[0].text == text[: text.find(stop) + len(stop)]


def test_streamed_deltas_never_pass_a_stop_string(tiny_llm, prompts):
    eng = tiny_llm.engine
    base = tiny_llm.generate([prompts[5]], GREEDY.clone(max_tokens=40))[0].outputs[0].text
    stop = base[len(base) // 2 : len(base) // 2 + 3]
    eng.add_request("stream", prompts[5], GREEDY.clone(max_tokens=40, stop=[stop]))
    streamed = ""
    while eng.has_unfinished_requests():
        for out in eng.step():
            streamed += out.outputs[0].delta_text
            assert stop not in streamed
    assert streamed == base[: base.find(stop)]


def test_abort_frees_every_block(tiny_models, prompts):
    llm = LLM(tiny_models("llama"), num_kv_blocks=300, max_model_len=1024, max_num_batched_tokens=64)
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, GREEDY.clone(max_tokens=100))
    for _ in range(6):
        eng.step()
    assert eng.kv.num_free_blocks < 300
    for i in range(len(prompts)):
        assert eng.abort_request(f"r{i}")
    assert eng.kv.num_free_blocks == 300
    assert not eng.has_unfinished_requests() and not eng.scheduler.running and not eng.scheduler.waiting


def test_bad_requests_are_rejected_clearly(tiny_llm):
    with pytest.raises(ValueError, match="exceeds the context"):
        tiny_llm.generate(["hello"], SamplingParams(max_tokens=5000))
    with pytest.raises(ValueError, match="empty"):
        tiny_llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM("x", not_an_option=1)
    assert not tiny_llm.engine.has_unfinished_requests()
