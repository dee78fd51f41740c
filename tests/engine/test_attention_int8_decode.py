"""attention_int8_decode: over an int8 cache, the sequences the packed integer-score path does not
take (decodes, chunks under int8_rows) have q rounded to int8 and score against the key codes read in
place from the pool (attention_int8_decode.h). The kernel against a float64 reference over the
rounded queries, what it leaves to the float path, the switch, and the engine with it against the
engine without it."""

from __future__ import annotations

import pytest
import torch

from hasten import LLM
from hasten.kernels import cpu_attention
from tests.engine.test_attention_kernel import (
    CASES,
    attention_on_threads,
    make_inputs,
    reference,
    shared_prefix_inputs,
)
from tests.engine.test_int8_kv_cache import INT8_SCORE_CASES, int8_inputs, round_queries

pytestmark = pytest.mark.skipif(cpu_attention.load() is None, reason="C++ kernels cannot be built here")

DECODE_CASES = CASES + INT8_SCORE_CASES[3:4] + [
    ([300, 17, 64, 1, 129], [1, 1, 1, 1, 1], 9, 3, 64, 32),  # decodes over blocks of 32 (two passes of 16 keys)
    ([40, 700], [5, 1], 16, 2, 256, 16),  # head_dim 256 (four 64-byte passes), 8 query heads per kv head
    ([90, 12], [1, 12], 5, 5, 96, 8),  # MHA over blocks of 8, head_dim 96 (a 32-byte tail)
]


def taken(head_dim: int) -> bool:
    return head_dim % 32 == 0 and head_dim <= 256 and cpu_attention.int8_decode_available()


@pytest.mark.parametrize("case", DECODE_CASES, ids=[f"case{i}" for i in range(len(DECODE_CASES))])
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_decode_matches_float64_over_the_rounded_queries(case, threads):
    ctx, new, heads, kv_heads, head_dim, block_size = case
    gen = torch.Generator().manual_seed(sum(ctx) * 3 + head_dim + block_size + threads)
    packed, dequant = int8_inputs(make_inputs(gen, ctx, new, heads, kv_heads, head_dim, block_size, torch.float32))
    scale = head_dim**-0.5
    got = attention_on_threads(threads, *packed, scale, int8_decode=True)
    plain = cpu_attention.paged_attention(*packed, scale)
    if not taken(head_dim):  # no VNNI path in this build, or a head size it does not take: the float path
        assert torch.equal(got, plain)
        return
    err = (got.double() - reference(round_queries(dequant[0], scale), *dequant[1:], scale)).abs()
    exact = (got.double() - reference(*dequant, scale)).abs()
    assert err.max().item() < 2e-5  # integer dot products are exact: float32 softmax and P V only
    if max(ctx) > 1:  # (over one key the weight is 1 whatever the score)
        assert exact.mean().item() > 100 * err.mean().item()  # the rounding of q is real, and is what it says


def test_int8_decode_beside_the_packed_path():
    # int8_rows takes the sequences with that many new tokens; int8_decode the rest, each as it does alone
    gen = torch.Generator().manual_seed(3)
    packed, _ = int8_inputs(make_inputs(gen, [100, 64, 9, 300], [100, 3, 9, 40], 9, 3, 64, 16, torch.float32))
    both = cpu_attention.paged_attention(*packed, 0.125, int8_rows=16, int8_decode=True)
    rows = torch.repeat_interleave(torch.tensor([100, 3, 9, 40]) >= 16, torch.tensor([100, 3, 9, 40]))
    alone = cpu_attention.paged_attention(*packed, 0.125, int8_decode=True)
    if cpu_attention.int8_scores_available():
        assert torch.equal(both[rows], cpu_attention.paged_attention(*packed, 0.125, int8_rows=16)[rows])
        assert torch.equal(both[~rows], alone[~rows])
    else:  # a build without the packed path (plain AVX2): int8_decode takes every sequence
        assert torch.equal(both, alone)
    if cpu_attention.int8_decode_available():
        assert not torch.equal(both[~rows], cpu_attention.paged_attention(*packed, 0.125)[~rows])


def test_int8_decode_leaves_soft_caps_short_windows_and_float_caches_alone():
    gen = torch.Generator().manual_seed(11)
    inputs = make_inputs(gen, [120, 40], [1, 1], 9, 3, 64, 16, torch.float32)
    packed, _ = int8_inputs(inputs)
    for kw in (dict(softcap=30.0), dict(window=50)):
        got = cpu_attention.paged_attention(*packed, 0.125, int8_decode=True, **kw)
        plain = cpu_attention.paged_attention(*packed, 0.125, **kw)
        if "window" in kw and cpu_attention.int8_decode_available():
            # the 120-token sequence's window stops short of key 0: the float path; the 40-token one's reaches
            # it (plain causal attention): taken
            assert torch.equal(got[:1], plain[:1]) and not torch.equal(got[1:], plain[1:])
        else:
            assert torch.equal(got, plain)
    assert torch.equal(cpu_attention.paged_attention(*inputs, 0.125, int8_decode=True),
                       cpu_attention.paged_attention(*inputs, 0.125))  # a float32 cache: nothing to take


@pytest.mark.parametrize("shape", [(9, 3, 64, 16), (8, 1, 128, 8)], ids=["gqa", "mqa"])
def test_int8_decode_prefix_groups_are_bit_identical(shape):
    heads, kv_heads, head_dim, bs = shape
    gen = torch.Generator().manual_seed(heads * 5 + head_dim)
    packed, dequant = int8_inputs(shared_prefix_inputs(gen, heads, kv_heads, head_dim, bs, torch.float32))
    scale = head_dim**-0.5
    alone = cpu_attention.paged_attention(*packed, scale, max_group=1, int8_decode=True)
    for g in (2, 8):
        assert torch.equal(cpu_attention.paged_attention(*packed, scale, max_group=g, int8_decode=True), alone)
    want = reference(round_queries(dequant[0], scale), *dequant[1:], scale) if taken(head_dim) else reference(*dequant, scale)
    assert (alone.double() - want).abs().max().item() < 2e-5


def test_int8_decode_switch_resolves(monkeypatch):
    from hasten.kernels import cpu_features

    resolve = cpu_features.resolve_int8_decode
    assert resolve("off", True) is False
    assert resolve("auto", False) is False  # another cache dtype: nothing to score in int8
    monkeypatch.setattr(cpu_attention, "int8_decode_available", lambda: True)
    assert resolve("auto", True) is True and resolve("on", False) is True
    monkeypatch.setattr(cpu_attention, "int8_decode_available", lambda: False)
    assert resolve("auto", True) is False
    with pytest.raises(ValueError, match="AVX-512 VNNI"):
        resolve("on", True)
    with pytest.raises(ValueError, match="attention_int8_decode must be one of"):
        resolve("yes", True)


def test_engine_with_int8_decode_stays_close_to_the_float_path(tiny_models):
    from tests.quant.wide_paths import assert_loops_agree, prompt_logprob_gap

    path = tiny_models("llama", hidden_size=128, num_heads=2, num_kv_heads=1)  # head_dim 64
    # 24-token steps, no packed path and no lane tiles: every prompt row goes through the rows
    # int8_decode takes
    kw = dict(kv_cache_dtype="int8", num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=24,
              attention_int8_scores="off", attention_lane_tiles="off")
    if not cpu_attention.int8_decode_available():  # a build without the path (portable): auto is off, on refused
        assert LLM(path, **kw).engine.model.prefill_attention.int8_decode is False
        with pytest.raises(ValueError, match="AVX-512 VNNI"):
            LLM(path, attention_int8_decode="on", **kw)
        return
    on = LLM(path, **kw)  # auto
    off = LLM(path, attention_int8_decode="off", **kw)
    assert on.engine.model.prefill_attention.int8_decode is True
    assert off.engine.model.prefill_attention.int8_decode is False
    assert LLM(path, num_kv_blocks=64, max_model_len=512).engine.model.prefill_attention.int8_decode is False  # float32 cache
    # the C++ layer loop and the Python one call the kernel alike: bit-identical
    assert_loops_agree(on, LLM(path, native_decoder_loop=False, **kw))
    assert 0.0 < prompt_logprob_gap(on, off) < 5e-2  # taken (the rounding shows), as close as the int8 cache itself is to float32
