"""Speculative decoding never changes what the model says."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hasten import LLM, SamplingParams
from hasten.engine.request import Request
from hasten.engine.sampler import Sampler
from hasten.engine.spec import DepthController, verify
from hasten.engine.spec.ngram import ngram_propose
from tests.engine.conftest import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def test_ngram_proposer_finds_the_latest_longest_match():
    toks = np.array([1, 2, 3, 4, 9, 9, 1, 2, 3, 5, 7, 1, 2, 3])
    assert ngram_propose(toks, 3) == [5, 7, 1]  # "1 2 3" last seen before position 9
    assert ngram_propose(np.array([4, 5, 6]), 2) == []
    assert ngram_propose(np.array([8, 1, 8]), 5) == [1, 8]
    # scaled depth: one draft after a 1-token match, up to 4 after 2 tokens, k after longer ones
    assert ngram_propose(np.array([8, 1, 8]), 5, short_match_depths=(1, 4)) == [1]
    two = np.array([6, 7, 1, 2, 3, 4, 5, 6, 7])
    assert ngram_propose(two, 6, short_match_depths=(1, 4)) == [1, 2, 3, 4]
    assert ngram_propose(toks, 3, short_match_depths=(1, 4)) == [5, 7, 1]


def _prompts(vocab):
    ps = random_prompts(10, vocab, seed=21, max_len=120)
    ps += [[5, 6, 7, 8, 9] * 12, [11, 12, 13] * 20, list(range(3, 60)) * 3]  # copy-friendly prompts
    return ps


@pytest.mark.parametrize("adaptive", [False, True])
def test_ngram_greedy_identical_batched_and_alone(tiny_models, adaptive):
    path = tiny_models("llama")
    base = LLM(path, num_kv_blocks=512, max_model_len=1024)
    spec = LLM(path, num_kv_blocks=512, max_model_len=1024, speculative="ngram", speculative_adaptive=adaptive)
    prompts = _prompts(base.engine.model_config.vocab_size)
    ref = [o.outputs[0].token_ids for o in base.generate(prompts, GREEDY)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, GREEDY)] == ref
    assert [spec.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts[-4:]] == ref[-4:]
    st = spec.engine.get_stats()
    assert st.spec_proposed_tokens > 0 and st.spec_accepted_tokens > 0
    assert st.spec_emitted_tokens > st.spec_accepted_tokens
    assert spec.engine.kv.num_free_blocks == 512  # nothing leaked, rejected slots included


def test_ngram_with_preemption_prefix_cache_and_stops(tiny_models):
    path = tiny_models("llama")
    base = LLM(path, num_kv_blocks=512, max_model_len=512)
    spec = LLM(path, num_kv_blocks=40, max_model_len=512, speculative="ngram", speculative_adaptive=False,
               max_num_batched_tokens=96)
    prompts = _prompts(base.engine.model_config.vocab_size)
    ref = [o.outputs[0] for o in base.generate(prompts, GREEDY)]
    got = [o.outputs[0] for o in spec.generate(prompts, GREEDY)]
    assert spec.engine.get_stats().num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    again = spec.generate(prompts[-3:], GREEDY)  # prefix-cache hits now
    assert sum(o.num_cached_tokens for o in again) > 0
    assert [o.outputs[0].token_ids for o in again] == [o.token_ids for o in ref[-3:]]
    # max_tokens, stop token ids and logprobs behave exactly as without speculation
    sp = GREEDY.clone(max_tokens=7, logprobs=2, stop_token_ids=[ref[-1].token_ids[5]])
    a = base.generate(prompts[-2:], sp)
    b = spec.generate(prompts[-2:], sp)
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].finish_reason == y.outputs[0].finish_reason
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            assert lx.keys() == ly.keys()
            assert all(abs(lx[t] - ly[t]) < 1e-4 for t in lx)
    assert spec.engine.kv.num_free_blocks == 40


def _chi_square_p(counts_a: np.ndarray, counts_b: np.ndarray) -> float:
    """Two-sample chi-square test of homogeneity; returns the p-value."""
    from math import exp, lgamma, log

    keep = (counts_a + counts_b) > 0
    a, b = counts_a[keep].astype(float), counts_b[keep].astype(float)
    na, nb = a.sum(), b.sum()
    tot = a + b
    ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
    stat = float(((a - ea) ** 2 / ea).sum() + ((b - eb) ** 2 / eb).sum())
    dof = int(keep.sum()) - 1
    # upper tail of chi2(dof) by series for the regularized lower gamma function
    x, s = stat / 2.0, dof / 2.0
    term = total = 1.0 / s
    for n in range(1, 1000):
        term *= x / (s + n)
        total += term
    lower = exp(s * log(x) - x - lgamma(s)) * total if x > 0 else 0.0
    return max(0.0, 1.0 - lower)


def _emitted_distribution(rule, trials: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Histogram of the first and second emitted tokens under a verification rule."""
    g = torch.Generator().manual_seed(seed)
    vocab = 6
    rows = torch.randn(3, vocab, generator=g) * 1.5
    draft = torch.softmax(torch.randn(2, vocab, generator=g), -1)
    sampler = Sampler(vocab)
    sampler.reseed(seed)
    first, second = np.zeros(vocab, int), np.zeros(vocab * vocab, int)
    params = SamplingParams(temperature=1.0, max_tokens=10)
    for _ in range(trials):
        req = Request("r", [1], params, [0])
        drafts = [int(torch.multinomial(draft[j], 1, generator=g)) for j in range(2)]
        out = rule(sampler, req, rows, drafts, draft)
        first[out[0]] += 1
        if len(out) > 1:  # second token only exists when the first draft was accepted
            second[out[0] * vocab + out[1]] += 1
    return first, second


def _reference_distribution(trials: int, seed: int):
    """Plain sampling from the target rows (no speculation)."""
    g = torch.Generator().manual_seed(seed)
    vocab = 6
    rows = torch.randn(3, vocab, generator=g) * 1.5
    p0 = torch.softmax(rows[0], -1)
    samples = torch.multinomial(p0, trials, replacement=True, generator=torch.Generator().manual_seed(seed + 1))
    return np.bincount(samples.numpy(), minlength=vocab)


def _correct_rule(sampler, req, rows, drafts, q):
    return verify(sampler, req, rows, drafts, q)[0]


def _broken_rule(sampler, req, rows, drafts, q):
    """Accepts with p/q but resamples from p instead of the residual max(p - q, 0): biased."""
    probs = torch.softmax(rows, -1)
    out = []
    for j, d in enumerate(drafts):
        if sampler.uniform_for(req) < min(1.0, float(probs[j, d] / q[j, d])):
            out.append(d)
            continue
        out.append(int(torch.multinomial(probs[j], 1, generator=sampler.generator)))
        return out
    out.append(int(torch.multinomial(probs[2], 1, generator=sampler.generator)))
    return out


@pytest.mark.parametrize("rule,should_pass", [(_correct_rule, True), (_broken_rule, False)])
def test_rejection_sampling_keeps_the_target_distribution(rule, should_pass):
    trials = 5000
    first, _ = _emitted_distribution(rule, trials, seed=3)
    ref = _reference_distribution(trials, seed=3)
    p = _chi_square_p(first, ref)
    assert (p > 0.001) == should_pass, p


def test_sampled_generation_distribution_unchanged_in_the_engine(tiny_models):
    """Token frequencies at a position reached through verification match those without speculation."""
    path = tiny_models("llama")
    base = LLM(path, num_kv_blocks=1024, max_model_len=512, max_num_seqs=128)
    spec = LLM(path, num_kv_blocks=1024, max_model_len=512, max_num_seqs=128, speculative="ngram",
               speculative_adaptive=False, num_speculative_tokens=3)
    vocab = base.engine.model_config.vocab_size
    prompt = list(range(3, vocab))  # every token occurs: n-gram always proposes
    sp = SamplingParams(temperature=1.5, top_k=6, max_tokens=4, ignore_eos=True, seed=None)
    n = 400

    def histogram(llm, seed):
        llm.engine.sampler.reseed(seed)
        outs = llm.generate([prompt] * n, sp)
        return np.bincount([o.outputs[0].token_ids[2] for o in outs], minlength=vocab)

    a, b = histogram(base, 1), histogram(spec, 2)
    assert spec.engine.get_stats().spec_proposed_tokens > n
    assert _chi_square_p(a, b) > 0.001


def test_depth_controller_turns_speculation_off_when_it_stops_paying():
    dc = DepthController(max_k=5, adaptive=True)
    for t in (1, 2, 4, 8, 16, 32, 64, 128, 256):  # steps cost 10 ms + 1 ms per token
        dc.record_step(t, 0.010 + 0.001 * t)
    assert abs(dc.cost_ratio() - 0.1) < 1e-6
    assert dc.choose([0.9], other_tokens=0) >= 2  # one request, good drafts: speculate
    assert dc.choose([0.1], other_tokens=0) == 0  # drafts keep failing
    assert dc.choose([0.6] * 64, other_tokens=0) == 0  # large batch: compute-bound, no gain
    assert DepthController(max_k=3, adaptive=False).choose([0.0], 0) == 3
    # a draft model that costs half a target step per draft token only pays with excellent drafts
    for _ in range(8):
        dc.record_proposal(4, 4 * 0.5 * 0.011)
    assert dc.choose([0.5], other_tokens=0) == 0
    assert dc.choose([0.97], other_tokens=0) >= 1


@pytest.fixture(scope="module")
def draft_paths(tiny_models):
    """A 1-layer draft with the target's tokenizer, and the target itself as a perfect draft."""
    return tiny_models("llama", num_layers=1, seed=5), tiny_models("llama")


@pytest.mark.parametrize("which", [0, 1], ids=["small-draft", "self-draft"])
def test_draft_model_greedy_identical_and_blocks_released(tiny_models, draft_paths, which):
    path = tiny_models("llama")
    base = LLM(path, num_kv_blocks=512, max_model_len=1024)
    spec = LLM(path, num_kv_blocks=512, max_model_len=1024, speculative=f"draft:{draft_paths[which]}",
               speculative_adaptive=False, num_speculative_tokens=3)
    prompts = _prompts(base.engine.model_config.vocab_size)[:8]
    ref = [o.outputs[0].token_ids for o in base.generate(prompts, GREEDY)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, GREEDY)] == ref
    st = spec.engine.get_stats()
    assert st.spec_proposer.startswith("draft:") and st.spec_proposed_tokens > 0
    if which == 1:  # the target drafting for itself is always right
        assert st.spec_accepted_tokens == st.spec_proposed_tokens
    assert spec.engine.kv.num_free_blocks == 512
    draft = spec.engine.proposer
    assert not draft.shadows and draft.kv.num_free_blocks == draft.kv.pool.num_blocks


def test_draft_model_sampling_distribution_unchanged(tiny_models, draft_paths):
    path = tiny_models("llama")
    base = LLM(path, num_kv_blocks=1024, max_model_len=512, max_num_seqs=128)
    spec = LLM(path, num_kv_blocks=1024, max_model_len=512, max_num_seqs=128, speculative=f"draft:{draft_paths[0]}",
               speculative_adaptive=False, num_speculative_tokens=2)
    sp = SamplingParams(temperature=1.2, top_k=6, max_tokens=3, ignore_eos=True)
    prompt = [7, 8, 9, 10] * 5
    vocab = base.engine.model_config.vocab_size

    def histogram(llm, seed):
        llm.engine.sampler.reseed(seed)
        return np.bincount([o.outputs[0].token_ids[2] for o in llm.generate([prompt] * 400, sp)], minlength=vocab)

    a, b = histogram(base, 3), histogram(spec, 4)
    assert spec.engine.get_stats().spec_proposed_tokens >= 400
    assert _chi_square_p(a, b) > 0.001


def test_spec_metrics_are_exposed(tiny_models):
    from hasten.server.metrics import EngineStatsCollector

    spec = LLM(tiny_models("llama"), num_kv_blocks=256, max_model_len=512, speculative="ngram",
               speculative_adaptive=False)
    spec.generate([[5, 6, 7, 8] * 10], GREEDY)
    fams = {f.name: f for f in EngineStatsCollector(lambda: spec.engine, lambda: "tiny").collect()}
    st = spec.engine.get_stats()
    drafted = fams["hasten:spec_decode_num_draft_tokens"].samples[0]
    assert drafted.labels["proposer"] == "ngram" and drafted.value == st.spec_proposed_tokens > 0
    assert fams["hasten:spec_decode_num_accepted_tokens"].samples[0].value == st.spec_accepted_tokens
    rate = fams["hasten:spec_decode_acceptance_rate"].samples[0].value
    assert abs(rate - st.spec_accepted_tokens / st.spec_proposed_tokens) < 1e-9
