"""Unit tests of the sampler, the block pool / prefix cache and the detokenizer."""

from __future__ import annotations

import pytest
import torch

from hasten.engine.detokenizer import IncrementalDetokenizer
from hasten.engine.kv_cache import BlockPool, KVCacheManager
from hasten.engine.request import Request
from hasten.engine.sampler import Sampler, apply_penalties, apply_top_k_top_p_min_p
from hasten.sampling_params import SamplingParams


def reference_filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Plain one-row reference: the set of tokens allowed, computed the slow obvious way."""
    probs = logits.softmax(-1)
    allowed = torch.ones_like(logits, dtype=torch.bool)
    if min_p > 0:
        allowed &= probs >= min_p * probs.max()
    masked = logits.masked_fill(~allowed, float("-inf"))
    order = masked.argsort(descending=True).tolist()
    keep = set()
    if top_k > 0:
        order = order[:top_k]
    p = masked[order].softmax(-1) if order else None
    total = 0.0
    for i, t in enumerate(order):
        if not allowed[t]:
            break
        keep.add(t)
        total += float(p[i])
        if total >= top_p:
            break
    return torch.tensor([i in keep for i in range(logits.shape[0])])


@pytest.mark.parametrize("seed", range(5))
def test_top_k_top_p_min_p_match_reference(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 50, generator=g) * 3
    ks = [0, 5, 1, 50, 10, 3]
    ps = [0.9, 1.0, 0.5, 0.3, 0.99, 0.7]
    mins = [0.0, 0.0, 0.0, 0.1, 0.05, 0.2]
    out = apply_top_k_top_p_min_p(logits, torch.tensor(ks), torch.tensor(ps), torch.tensor(mins))
    for i in range(6):
        got = torch.isfinite(out[i])
        want = reference_filter(logits[i], ks[i], ps[i], mins[i])
        assert torch.equal(got, want), i


def _req(params, prompt=(1, 2, 3), out=()):
    r = Request("r", list(prompt), params, [0])
    r.output_token_ids = list(out)
    return r


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    apply_penalties(logits, [_req(SamplingParams(repetition_penalty=2.0), prompt=[0], out=[1])])
    assert logits.tolist() == [[1.0, -4.0, 1.0, 0.5, 3.0]]
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    sp = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    apply_penalties(logits, [_req(sp, prompt=[4], out=[2, 2, 3])])
    assert torch.allclose(logits, torch.tensor([[2.0, -2.0, 1.0 - 0.5 - 0.5, 0.5 - 0.25 - 0.5, 3.0]]))


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    sampler = Sampler(4)
    reqs = [_req(SamplingParams(temperature=1.0)) for _ in range(4000)]
    toks, _ = sampler.sample(logits, reqs)
    freq = torch.bincount(torch.tensor(toks), minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)
    # tokens outside top-k are never drawn, the kept ones keep their relative odds
    toks, _ = sampler.sample(logits, [_req(SamplingParams(temperature=1.0, top_k=2)) for _ in range(4000)])
    freq = torch.bincount(torch.tensor(toks), minlength=4).float() / 4000
    assert freq[2:].sum() == 0 and abs(freq[0].item() - 0.625) < 0.03
    # temperature -> 0 is greedy
    toks, _ = sampler.sample(logits[:3], [_req(SamplingParams(temperature=0)) for _ in range(3)])
    assert toks == [0, 0, 0]


def test_inverse_cdf_draw_frequencies_and_zero_mass():
    """Sampler.draw over a vocabulary that is not a multiple of its chunk, mass in 4 tokens spread
    over several chunks: frequencies follow the probabilities, zero-probability tokens never come."""
    sampler = Sampler(1000)
    probs = torch.zeros(1000)
    probs[[3, 300, 511, 999]] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    reqs = [_req(SamplingParams(temperature=1.0)) for _ in range(20000)]
    freq = torch.bincount(sampler.draw(probs.repeat(20000, 1), reqs), minlength=1000).float() / 20000
    assert torch.allclose(freq[[3, 300, 511, 999]], probs[[3, 300, 511, 999]], atol=0.015)
    assert freq.sum().item() == pytest.approx(1.0) and freq[[3, 300, 511, 999]].sum().item() == pytest.approx(1.0)


def test_block_pool_lru_and_refcounts():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.register(a[0], b"h0")
    pool.register(a[1], b"h1")
    pool.release(list(reversed(a)))
    assert pool.num_free == 4 and pool.lookup(b"h0") == a[0]
    pool.touch([a[0]])  # prefix hit takes it back out of the free queue
    assert pool.num_free == 3
    got = pool.allocate(3)  # evicts the uncached blocks first, then the cached tail block
    assert a[0] not in got and pool.lookup(b"h1") is None and pool.lookup(b"h0") == a[0]
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_prefix_cache_hash_chain_and_salt():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sp = SamplingParams(max_tokens=1)
    r1 = Request("a", list(range(10)), sp, [0])
    assert kv.find_cached_prefix(r1) == []
    assert kv.allocate(r1, 10)
    r1.num_computed_tokens = 10
    kv.cache_computed_blocks(r1)
    r2 = Request("b", list(range(8)) + [99, 98, 97], sp, [0])
    assert kv.find_cached_prefix(r2) == r1.block_ids[:2]
    r3 = Request("c", [7] + list(range(1, 10)), sp, [0])  # differs in block 0: no hit at all
    assert kv.find_cached_prefix(r3) == []
    r4 = Request("d", list(range(10)), sp, [0], cache_salt="other-tenant")
    assert kv.find_cached_prefix(r4) == []
    # an exact repeat may reuse at most num_tokens - 1 tokens: 9 -> 2 full blocks
    r5 = Request("e", list(range(8)), sp, [0])
    assert len(kv.find_cached_prefix(r5)) == 1
    kv.free(r1)
    assert kv.num_free_blocks == 16


@pytest.fixture(scope="module")
def smol_tokenizer():
    from hasten.model.loader import resolve_model

    try:
        folder = resolve_model(None)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def test_incremental_detokenizer_is_utf8_safe(smol_tokenizer):
    text = "Héllo wörld! 😀🚀 漢字テスト — naïve café. Ελληνικά 🤖 done."
    ids = smol_tokenizer.encode(text)
    d = IncrementalDetokenizer(smol_tokenizer)
    pieces = []
    for t in ids:
        d.add_token(t)
        delta = d.take_delta(False)
        assert "\ufffd" not in delta
        pieces.append(delta)
    d.flush()
    pieces.append(d.take_delta(True))
    assert "".join(pieces) == smol_tokenizer.decode(ids) == text


def test_detokenizer_stop_string_holdback(smol_tokenizer):
    text = "one two three four five"
    ids = smol_tokenizer.encode(text)
    d = IncrementalDetokenizer(smol_tokenizer, stop=["ree fo"])
    out, hit = "", None
    for t in ids:
        hit = d.add_token(t)
        out += d.take_delta(hit is not None)
        assert "ree fo" not in out
        if hit:
            break
    assert hit == "ree fo" and out == "one two th"
