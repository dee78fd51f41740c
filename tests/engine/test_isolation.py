"""Per-request failure isolation in the engine: bad token ids are refused at admission, and an
exception raised while handling one request's rows fails that request alone."""

from __future__ import annotations

import pytest

from hasten import LLM, SamplingParams
from hasten.engine.sampler import Sampler


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models("llama"), num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=128)


def _greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, **kw})


def test_out_of_vocab_ids_are_refused_at_admission(llm):
    vocab = llm.engine.model_config.vocab_size
    bad = [
        _greedy(min_tokens=2, stop_token_ids=[vocab]),  # the request that used to kill the engine
        _greedy(logit_bias={vocab + 5: 1.0}),
    ]
    for params in bad:
        with pytest.raises(ValueError, match="out of range"):
            llm.generate([[5, 6, 7]], params)
    assert not llm.engine.has_unfinished_requests()
    # the same request with an in-vocabulary id works (min_tokens masking included)
    out = llm.generate([[5, 6, 7]], _greedy(min_tokens=2, stop_token_ids=[vocab - 1]))[0]
    assert out.error is None and len(out.outputs[0].token_ids) >= 2
    with pytest.raises(ValueError, match="logit_bias values"):
        SamplingParams(logit_bias={3: 101.0})
    with pytest.raises(ValueError, match="logit_bias values"):
        SamplingParams(logit_bias={3: float("nan")})


def test_logit_bias_is_applied(llm):
    prompt = [[5, 6, 7, 8]]
    base = llm.generate(prompt, _greedy())[0].outputs[0].token_ids
    forced = llm.generate(prompt, _greedy(logit_bias={42: 100.0}))[0].outputs[0].token_ids
    assert forced == [42] * 8
    banned = llm.generate(prompt, _greedy(logit_bias={base[0]: -100.0}))[0].outputs[0].token_ids
    assert banned[0] != base[0]


def test_a_failing_processor_fails_only_its_request(llm):
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(12))]

    def explode(output_ids, logits):
        if len(output_ids) == 3:
            raise IndexError("processor bug on the fourth token")

    params = [_greedy(12), _greedy(12, logits_processors=[explode]), _greedy(12)]
    outs = llm.generate(prompts, params)
    assert outs[1].finished and outs[1].error is not None and "IndexError" in outs[1].error
    assert outs[1].outputs[0].finish_reason == "error"
    assert outs[1].outputs[0].token_ids == expected[1][:3]
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [expected[0], expected[2]]
    assert llm.engine.kv.usage == 0.0 or llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks
    # the engine keeps serving
    assert llm.generate(prompts[:1], _greedy(12))[0].outputs[0].token_ids == expected[0]


def test_every_sequence_of_a_failed_request_ends(llm):
    def explode(output_ids, logits):
        raise RuntimeError("always")

    outs = llm.generate([[5, 6, 7], [8, 9]], [_greedy(4, n=3, seed=1, temperature=0.8, logits_processors=[explode]),
                                              _greedy(4)])
    assert outs[0].error is not None
    assert all(c.finish_reason == "error" for c in outs[0].outputs)
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 4
    assert not llm.engine.has_unfinished_requests()


def test_batched_sampler_failure_falls_back_to_rows(llm, monkeypatch):
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(6))]
    real = Sampler.sample
    calls = {"batched_failures": 0}

    def flaky(self, logits, reqs):
        if len(reqs) > 1:  # the batched call fails; rows on their own succeed
            calls["batched_failures"] += 1
            raise RuntimeError("batched path bug")
        return real(self, logits, reqs)

    monkeypatch.setattr(Sampler, "sample", flaky)
    outs = llm.generate(prompts, _greedy(6))
    assert calls["batched_failures"] > 0
    assert [o.error for o in outs] == [None, None]
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_detokenizer_failure_fails_only_its_request(llm, monkeypatch):
    from hasten.engine import detokenizer

    real = detokenizer.IncrementalDetokenizer.add_token
    victims = set()

    def add_token(self, tok):
        if id(self) in victims:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "simulated")
        return real(self, tok)

    monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "add_token", add_token)
    eng = llm.engine
    eng.add_request("ok", [5, 6, 7], _greedy(5))
    eng.add_request("bad", [8, 9, 10], _greedy(5))
    victims.add(id(eng.groups["bad"].detoks[0]))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert done["bad"].error is not None and "UnicodeDecodeError" in done["bad"].error
    assert done["ok"].error is None and len(done["ok"].outputs[0].token_ids) == 5
