"""EAGLE draft heads: speculation with a head keeps the target's output exactly (greedy) and in
distribution (sampled); a head trained on the target's own features is accepted far more often
than an untrained one; bad heads are refused clearly; `hasten distill draft` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hasten import LLM, SamplingParams  # noqa: E402
from hasten.distill.draft import (  # noqa: E402
    FeatureRecorder,
    HeadTrainer,
    init_head,
    label_greedy,
    record,
    reduced_vocabulary,
    windows_of,
)
from hasten.distill.train import DistillConfig  # noqa: E402
from hasten.model.config import ModelConfig  # noqa: E402
from hasten.model.eagle import EagleConfig, EagleHead, tokenizer_fingerprint  # noqa: E402
from hasten.model.loader import load_hf_config  # noqa: E402
from tests.spec.test_spec_decoding import _chi_square_p  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _target_weights(path: str) -> tuple[ModelConfig, dict]:
    from safetensors.torch import load_file

    return ModelConfig.from_hf(load_hf_config(Path(path))), load_file(str(Path(path) / "model.safetensors"))


def _new_head(path: str, token_map: torch.Tensor, seed: int = 0) -> EagleHead:
    from transformers import AutoTokenizer

    cfg, state = _target_weights(path)
    head = EagleHead(EagleConfig.for_target(cfg, len(token_map), tokenizer_fingerprint(AutoTokenizer.from_pretrained(path))))
    lm_head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    init_head(head, lm_head, state["model.norm.weight"], token_map, seed)
    return head


def _prompts(vocab: int, n: int = 8, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(k),), generator=g).tolist() for k in torch.randint(2, 90, (n,), generator=g)]


@pytest.fixture(scope="module")
def target(tiny_models):
    return tiny_models("llama")  # 4 heads over 2 KV heads (GQA)


@pytest.fixture(scope="module")
def untrained_head(target, tmp_path_factory):
    cfg, _ = _target_weights(target)
    folder = tmp_path_factory.mktemp("eagle-untrained")
    _new_head(target, torch.arange(0, cfg.vocab_size, 2)).save(folder)  # half the vocabulary
    return folder


@pytest.fixture(scope="module")
def trained_head(target, tmp_path_factory):
    """A head trained for a few seconds on the tiny target's own greedy continuations."""
    cfg, state = _target_weights(target)
    llm = LLM(target, num_kv_blocks=512, max_model_len=512, enable_prefix_caching=False)
    seqs = record(llm, _prompts(cfg.vocab_size, n=120, seed=7), 48)
    assert len(seqs) == 120 and all(s.feats.shape == (len(s.ids), cfg.hidden_size) for s in seqs)
    windows = windows_of(seqs, 64)
    train, held = windows[:-20], windows[-20:]
    lm_head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    label_greedy(held, lm_head)
    token_map = reduced_vocabulary([w.ids for w in train], cfg.vocab_size, cfg.eos_token_ids, cfg.vocab_size)
    head = _new_head(target, token_map)
    config = DistillConfig(steps=200, batch_size=4, lr=1e-2, warmup_steps=10, eval_every=200, checkpoint_every=1000)
    trainer = HeadTrainer(head, state["model.embed_tokens.weight"], lm_head, train, held, config)
    state_ = trainer.run()
    first, last = state_.history[0]["heldout_top1"], state_.history[-1]["heldout_top1"]
    # a random 2-layer target is far from predictable: a few seconds of training lift held-out
    # agreement with its greedy tokens from ~0 to ~0.1
    assert last > first + 0.05, (first, last)
    folder = tmp_path_factory.mktemp("eagle-trained")
    head.save(folder)
    return folder


def _spec_llm(target: str, head: Path, depth: int = 3, method: str = "eagle", **kw) -> LLM:
    return LLM(target, num_kv_blocks=512, max_model_len=1024, speculative=f"{method}:{head}", speculative_adaptive=False,
               num_speculative_tokens=depth, **kw)


@pytest.mark.parametrize("which", ["untrained", "trained", "trained-int8", "hybrid"])
def test_greedy_identical_batched_and_alone_with_prefix_hits_and_chunks(target, untrained_head, trained_head, which):
    head = untrained_head if which == "untrained" else trained_head
    base = LLM(target, num_kv_blocks=512, max_model_len=1024)
    quant = "int8" if which.endswith("int8") else "none"
    method = "ngram+eagle" if which == "hybrid" else "eagle"
    spec = _spec_llm(target, head, max_num_batched_tokens=32,  # prompts arrive in chunks
                     speculative_draft_quantization=quant, method=method)
    if quant == "int8":
        assert type(spec.engine.proposer.head.lm_head).__name__ == "Int8Linear"
    prompts = _prompts(base.engine.model_config.vocab_size)
    prompts.append(prompts[0][:40] + [5, 6, 7])  # shares a cached prefix with the first
    prompts.append(prompts[1][:30] * 3)  # repeats itself: prompt lookup finds long matches
    ref = [o.outputs[0].token_ids for o in base.generate(prompts, GREEDY)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, GREEDY)] == ref
    assert [spec.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts[:3]] == ref[:3]
    st = spec.engine.get_stats()
    assert st.spec_proposer.startswith(f"{method}:") and st.spec_proposed_tokens > 0
    eagle = spec.engine.proposer.eagle if which == "hybrid" else spec.engine.proposer
    assert not eagle.states  # every request's head state was released
    if which == "hybrid":  # both sides drafted
        assert spec.engine.proposer.lookup_drafts > 0 and spec.engine.proposer.head_drafts > 0
    assert spec.engine.kv.num_free_blocks == 512


def test_a_trained_head_is_accepted_far_more_than_an_untrained_one(target, untrained_head, trained_head):
    rates = {}
    for name, head, quant in (("untrained", untrained_head, "none"), ("trained", trained_head, "none"),
                              ("trained-int8", trained_head, "int8")):
        spec = _spec_llm(target, head, depth=1, speculative_draft_quantization=quant)  # the first draft
        spec.generate(_prompts(spec.engine.model_config.vocab_size, n=8, seed=11), GREEDY)  # prompts not trained on
        st = spec.engine.get_stats()
        rates[name] = st.spec_accepted_tokens / st.spec_proposed_tokens
    assert rates["trained"] > max(3 * rates["untrained"], rates["untrained"] + 0.05), rates
    assert rates["trained-int8"] > 0.8 * rates["trained"], rates  # int8 weights barely change the head


@pytest.mark.parametrize("method", ["eagle", "ngram+eagle"])
def test_sampling_distribution_unchanged_with_a_trained_head(target, trained_head, method):
    base = LLM(target, num_kv_blocks=1024, max_model_len=512, max_num_seqs=128)
    spec = LLM(target, num_kv_blocks=1024, max_model_len=512, max_num_seqs=128, speculative=f"{method}:{trained_head}",
               speculative_adaptive=False, num_speculative_tokens=2)
    sp = SamplingParams(temperature=1.0, top_k=8, max_tokens=3, ignore_eos=True)
    prompt = _prompts(base.engine.model_config.vocab_size, n=1, seed=3)[0]
    vocab = base.engine.model_config.vocab_size

    def histogram(llm, seed):
        llm.engine.sampler.reseed(seed)
        return np.bincount([o.outputs[0].token_ids[2] for o in llm.generate([prompt] * 400, sp)], minlength=vocab)

    a, b = histogram(base, 3), histogram(spec, 4)
    st = spec.engine.get_stats()
    assert st.spec_proposed_tokens >= 400 and st.spec_accepted_tokens > 0
    if method == "ngram+eagle":  # sampled tokens rarely extend a repeat: the head drafts (lookup: greedy test)
        assert spec.engine.proposer.head_drafts > 0
    assert _chi_square_p(a, b) > 0.001


def test_heads_that_do_not_fit_are_refused_clearly(target, tiny_models, untrained_head, tmp_path):
    with pytest.raises(ValueError, match="not an EAGLE draft folder"):
        LLM(target, num_kv_blocks=64, max_model_len=256, speculative=f"eagle:{tmp_path}")
    other = tiny_models("llama", hidden_size=96)  # same tokenizer, other width: refused by shape
    with pytest.raises(ValueError, match="features of width"):
        LLM(other, num_kv_blocks=64, max_model_len=256, speculative=f"eagle:{untrained_head}")
    bad = tmp_path / "other-tokenizer"
    bad.mkdir()
    raw = json.loads((untrained_head / "eagle.json").read_text())
    raw["tokenizer_fingerprint"] = "0" * 16
    (bad / "eagle.json").write_text(json.dumps(raw))
    (bad / "eagle.safetensors").write_bytes((untrained_head / "eagle.safetensors").read_bytes())
    with pytest.raises(ValueError, match="another tokenizer"):
        LLM(target, num_kv_blocks=64, max_model_len=256, speculative=f"eagle:{bad}")


def test_feature_recorder_keeps_the_latest_rows_and_reports_gaps():
    class _Req:
        def __init__(self, rid, computed):
            self.request_id, self.num_computed_tokens = rid, computed

    class _Batch:
        def __init__(self, reqs, ns):
            self.requests, self.num_new_tokens = reqs, ns

    rec = FeatureRecorder()
    rec.observe(_Batch([_Req("a", 0), _Req("b", 0)], [3, 2]), torch.arange(10.0).view(5, 2))
    rec.observe(_Batch([_Req("a", 2)], [2]), torch.full((2, 2), 9.0))  # position 2 again (a preemption)
    assert rec.take("a", 4).tolist() == [[0, 1], [2, 3], [9, 9], [9, 9]]
    assert rec.take("b", 3) is None  # position 2 of b was never computed
    assert rec.buffers == {}


def test_distill_draft_cli_end_to_end_with_a_budget_stop_and_resume(target, tmp_path, capsys):
    from hasten.distill.cli import main

    out = tmp_path / "head"
    common = ["draft", target, "--out", str(out), "--prompts", "6", "--heldout-prompts", "2", "--answer-tokens", "12",
              "--sharegpt-tokens", "256", "--seq-len", "64", "--max-prompt-tokens", "200", "--steps", "6",
              "--batch-size", "2", "--eval-every", "3", "--draft-vocab", "128"]
    with pytest.raises(SystemExit) as e:
        main(["draft", target, "--out", target])
    assert e.value.code == 2 and "must not be the target" in capsys.readouterr().err
    for bad, says in ((["--unroll", "0"], "--unroll must be at least 1"), (["--feature-weight", "-1"], "negative"),
                      (["--engine-arg", "no_such_option=1"], "--engine-arg"), (["--engine-arg", "x"], "KEY=VALUE")):
        with pytest.raises(SystemExit) as e:
            main([*common, *bad])
        assert e.value.code == 2 and says in capsys.readouterr().err
    assert not out.exists()  # nothing written for a refused command
    assert main([*common, "--max-minutes", "0"]) == 3  # budget spent at once: checkpoint, exit 3
    assert (out / "distill-checkpoint.pt").exists() and (out / "draft-data.pt").exists()
    assert main(common) == 0  # resumes (data reused) and finishes
    report = json.loads((out / "draft.json").read_text())
    assert report["finished"] and report["steps"] == 6 and report["draft_vocab"] == 128
    assert "reusing the target's answers" in capsys.readouterr().out
    head = EagleHead.load(out)
    assert head.token_map.shape == (128,) and not (out / "distill-checkpoint.pt").exists()
    with pytest.raises(SystemExit) as e:  # a finished head is not overwritten silently
        main(common)
    assert e.value.code == 2
    llm = LLM(target, num_kv_blocks=128, max_model_len=256, speculative=f"eagle:{out}")
    assert len(llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids) == 24


def test_unrolled_training_computes_what_drafting_computes_step_by_step():
    """The head's training form (all positions at once, later steps on its own predictions) equals the
    proposer's incremental drafting: catch up on the target's features to position t, then draft."""
    from types import SimpleNamespace

    from hasten.engine.spec.eagle import EagleProposer

    torch.manual_seed(0)
    cfg = EagleConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                      rms_norm_eps=1e-6, rope_theta=10000.0, target_vocab_size=50, draft_vocab_size=50,
                      tokenizer_fingerprint="x")
    head = EagleHead(cfg).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    table = torch.randn(50, 64)
    n = 12
    ids, feats = torch.randint(0, 50, (n + 1,)), torch.randn(n + 1, 64)
    with torch.no_grad():
        preds = head.unrolled(table[ids[1:]], feats[:-1], 3)
        assert [p.shape[0] for p in preds] == [n, n - 1, n - 2]
        torch.testing.assert_close(preds[0], head(table[ids[1:]][None], feats[:-1][None])[0])
    proposer = EagleProposer.__new__(EagleProposer)
    proposer.head, proposer.target = head, SimpleNamespace(_embed=lambda i: table[i])
    with torch.inference_mode():
        for t in (0, 4, 9):
            st = proposer._new_state(0)
            got = proposer._run([(st, ids[1 : t + 2], feats[: t + 1], 0)])  # the target's features 0..t
            torch.testing.assert_close(got[0], preds[0][t])
            for s in (2, 3):  # each further draft from the previous prediction and the next token
                got = proposer._run([(st, ids[t + s : t + s + 1], got, t + s - 1)])
                torch.testing.assert_close(got[0], preds[s - 1][t], rtol=1e-4, atol=1e-5)


def test_hybrid_keeps_one_acceptance_estimate_per_side():
    """plan() picks the drafting side per request and step and swaps that side's estimate into the
    request (the engine's running estimate), so each side's verified drafts move only its own."""
    from types import SimpleNamespace

    from hasten.engine.spec.hybrid import HybridProposer

    class StubHead:
        name = "eagle:stub"

        def __init__(self):
            self.asked: list[tuple[str, int]] = []

        def propose_batch(self, reqs, ks):
            for r, k in zip(reqs, ks, strict=True):
                self.asked.append((r.request_id, k))
                r.spec_token_ids = [7] * k

        def release(self, request_id):
            pass

    head = StubHead()
    hybrid = HybridProposer(head, max_depth=4)
    repeat = [1, 2, 3, 4, 5, 6, 1, 2]  # ends in "1 2", seen before: the lookup drafts 3 4 5 6
    fresh = [9, 8, 7, 6, 5, 4, 3, 11]  # nothing repeats
    req = SimpleNamespace(request_id="a", spec_acceptance=0.7, spec_token_ids=[], spec_probs=None, tokens=repeat)
    req.all_token_ids = lambda: req.tokens
    hybrid.plan([req])
    hybrid.propose_batch([req], [3])
    assert req.spec_token_ids == [3, 4, 5] and head.asked == []
    req.spec_acceptance = 0.95  # the engine after verifying lookup drafts
    req.tokens = fresh
    hybrid.plan([req])
    assert req.spec_acceptance == 0.7  # the head's own estimate
    hybrid.propose_batch([req], [2])
    assert req.spec_token_ids == [7, 7] and head.asked == [("a", 2)]
    req.spec_acceptance = 0.2  # the head's drafts were rejected
    req.tokens = repeat
    hybrid.plan([req])
    assert req.spec_acceptance == 0.95
    assert hybrid.lookup_drafts == 1 and hybrid.head_drafts == 1
    hybrid.release("a")
    assert not hybrid._estimates and not hybrid._side and not hybrid._lookup
