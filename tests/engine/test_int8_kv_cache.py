"""kv_cache_dtype="int8": each head's row of each token stored as int8 codes and its float32 absmax
scale (head_dim + 4 bytes). The C++ RoPE + cache op against a PyTorch rounding of the float32
result, the attention kernel against a float64 reference over the dequantized values, and the
engine against transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hasten import LLM, SamplingParams
from hasten.kernels import cpu_attention, decoder_ops
from hasten.model.dtypes import INT8_KV_SCALE_BYTES, kv_bytes_per_token, resolve_kv_cache_dtype
from tests.engine.conftest import hf_greedy, random_prompts
from tests.engine.test_attention_kernel import (
    CASES,
    attention_on_threads,
    make_inputs,
    reference,
    shared_prefix_inputs,
)

pytestmark = pytest.mark.skipif(cpu_attention.load() is None, reason="C++ kernels cannot be built here")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float32 -> (packed int8 rows [..., D + 4], the values they stand for [..., D])."""
    amax = x.abs().amax(-1, keepdim=True)
    scale = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(x * inv).to(torch.int8)
    packed = torch.cat([codes, scale.contiguous().view(torch.int8)], -1).contiguous()
    return packed, codes.float() * scale


def dequantize_rows(packed: torch.Tensor) -> torch.Tensor:
    d = packed.shape[-1] - INT8_KV_SCALE_BYTES
    scale = packed[..., d:].contiguous().view(torch.float32)
    return packed[..., :d].float() * scale


def int8_inputs(inputs):
    q, k, v, tables, qs, cl = inputs
    k8, kd = quantize_rows(k.float())
    v8, vd = quantize_rows(v.float())
    return (q, k8, v8, tables, qs, cl), (q, kd, vd, tables, qs, cl)


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
@pytest.mark.parametrize("threads", [1, 2])
def test_attention_over_an_int8_cache_matches_float64_over_its_values(case, threads):
    ctx, new, heads, kv_heads, head_dim, block_size = case
    gen = torch.Generator().manual_seed(len(ctx) * 131 + head_dim + sum(new))
    packed, dequant = int8_inputs(make_inputs(gen, ctx, new, heads, kv_heads, head_dim, block_size, torch.float32))
    assert packed[1].shape[-1] == head_dim + 4 and packed[1].dtype == torch.int8
    scale = head_dim**-0.5
    got = attention_on_threads(threads, *packed, scale)
    want = reference(*dequant, scale)
    assert (got.double() - want).abs().max().item() < 2e-5


@pytest.mark.parametrize("shape", [(9, 3, 64, 16), (6, 2, 20, 8)], ids=["gqa", "portable"])
def test_shared_prefix_groups_over_an_int8_cache_are_bit_identical(shape):
    heads, kv_heads, head_dim, bs = shape
    gen = torch.Generator().manual_seed(heads * 7 + head_dim)
    packed, dequant = int8_inputs(shared_prefix_inputs(gen, heads, kv_heads, head_dim, bs, torch.float32))
    scale = head_dim**-0.5
    alone = cpu_attention.paged_attention(*packed, scale, max_group=1)
    for g in (2, 8):
        assert torch.equal(cpu_attention.paged_attention(*packed, scale, max_group=g), alone)
    assert (alone.double() - reference(*dequant, scale)).abs().max().item() < 2e-5


def test_wide_rows_take_bfloat16_sdpa_over_the_dequantized_cache():
    gen = torch.Generator().manual_seed(5)
    packed, dequant = int8_inputs(make_inputs(gen, [100, 64, 40], [100, 1, 33], 9, 3, 64, 16, torch.float32))
    got = cpu_attention.paged_attention(*packed, 0.125, wide_rows=32)
    assert (got.double() - reference(*dequant, 0.125)).abs().max().item() < 3e-2


def test_attention_refuses_an_int8_cache_without_room_for_the_scale():
    gen = torch.Generator().manual_seed(1)
    q, k, v, tables, qs, cl = make_inputs(gen, [20], [1], 4, 2, 16, 16, torch.float32)
    codes = torch.zeros(k.shape, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="head_dim"):
        cpu_attention.paged_attention(q, codes, codes, tables, qs, cl, 0.25)


def test_rope_writes_int8_rows_of_the_float32_result():
    ops = decoder_ops.load()
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, d, tokens, bs = 9, 3, 64, 7, 16
    angles = torch.rand(128, d // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen)
    qkv[0, (heads + kv_heads) * d :] = 0.0  # an all-zero value row: scale 0, codes 0
    positions = torch.randint(0, 128, (tokens,), generator=gen)
    slots = torch.randperm(4 * bs, generator=gen)[:tokens]
    k32, v32 = torch.zeros(4, bs, kv_heads, d), torch.zeros(4, bs, kv_heads, d)
    q32 = ops.rope_and_cache(qkv, cos, sin, positions, slots, k32, v32, heads, kv_heads)
    k8 = torch.zeros(4, bs, kv_heads, d + 4, dtype=torch.int8)
    v8 = torch.zeros_like(k8)
    q8 = ops.rope_and_cache(qkv, cos, sin, positions, slots, k8, v8, heads, kv_heads)
    assert torch.equal(q8, q32)
    flat = lambda t: t.view(-1, kv_heads, t.shape[-1])  # noqa: E731
    assert torch.equal(flat(k8)[slots], quantize_rows(flat(k32)[slots])[0])
    assert torch.equal(flat(v8)[slots], quantize_rows(flat(v32)[slots])[0])
    assert not flat(v8)[slots[0]].any()
    untouched = torch.ones(4 * bs, dtype=torch.bool)
    untouched[slots] = False
    assert not flat(k8)[untouched].any() and not flat(v8)[untouched].any()
    err = (dequantize_rows(flat(k8)[slots]) - flat(k32)[slots]).abs().amax(-1)
    assert (err <= flat(k32)[slots].abs().amax(-1) / 254 * 1.0001).all()  # half a step of its row's scale


def test_int8_kv_bytes_and_names():
    assert resolve_kv_cache_dtype("int8", torch.float32) == torch.int8
    assert kv_bytes_per_token(30, 3, 64, torch.int8) == 2 * 30 * 3 * 68
    with pytest.raises(ValueError, match="int8"):
        resolve_kv_cache_dtype("fp8", torch.float32)


def test_engine_with_an_int8_cache_stays_close_to_transformers(tiny_models):
    path = tiny_models("llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(8, hf.config.vocab_size, seed=19, min_len=20, max_len=120)
    llm = LLM(path, kv_cache_dtype="int8", num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=64)
    k_cache = llm.engine.runner.kv_caches[0][0]
    assert k_cache.dtype == torch.int8 and k_cache.shape[-1] == llm.engine.model_config.head_dim + 4
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0))
    worst = 0.0
    for p, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            logp = hf(torch.tensor([p])).logits[0].log_softmax(-1)
        for i in range(1, len(p)):
            worst = max(worst, abs(out.prompt_logprobs[i][p[i]] - logp[i - 1, p[i]].item()))
    assert 0.0 < worst < 5e-2  # rounded (not exact), and close
    ref = hf_greedy(hf, prompts, 16)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    # a random tiny model has near-ties that a rounded cache may flip; most continuations stay equal
    assert sum(g == r for g, r in zip(got, ref, strict=True)) >= 6


@pytest.mark.parametrize("options,why", [
    ({"attention_backend": "sdpa"}, "C\\+\\+ attention kernel"),
    ({"fused_decoder_ops": False}, "fused_decoder_ops"),
    ({"block_size": 512}, "block_size up to 256"),
])
def test_engine_refuses_an_int8_cache_where_no_kernel_reads_it(tiny_models, options, why):
    with pytest.raises(ValueError, match=why):
        LLM(tiny_models("llama"), kv_cache_dtype="int8", num_kv_blocks=64, max_model_len=256, **options)


INT8_SCORE_CASES = [
    ([100, 64, 9, 300], [100, 3, 9, 40], 9, 3, 64, 16),  # whole prefill, spec verify, decode, chunk after context
    ([45, 90, 33], [45, 33, 1], 28, 4, 128, 16),  # 7 query heads per kv head, head_dim 128
    ([70, 20], [70, 20], 6, 2, 96, 8),  # head_dim 96, blocks of 8 (units of 16 keys span two blocks)
    ([200], [57], 4, 4, 64, 32),  # MHA, blocks of 32, a chunk after 143 tokens
    ([33, 70], [33, 1], 6, 2, 20, 16),  # head_dim 20: not taken, the float path
]


def int8_prefill_engine_args(tiny_models) -> tuple[str, dict]:
    """A tiny model with head_dim 64 and engine options under which its prefill chunks (24-token steps,
    from 4 rows) take the int8 cache's integer-score paths: for the tests of those paths' switches."""
    path = tiny_models("llama", hidden_size=128, num_heads=2, num_kv_heads=1)
    return path, dict(kv_cache_dtype="int8", num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=24,
                      attention_int8_scores_min_rows=4)


def round_queries(q: torch.Tensor, scale: float) -> torch.Tensor:
    """The queries attention_int8_scores.h computes with: q * scale rounded to int8 per row (absmax /
    127, half to even), divided by scale again so that reference() may apply it."""
    qs = q.double() * scale
    amax = qs.abs().amax(-1, keepdim=True)
    return torch.round(qs * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))) * (amax / 127.0) / scale


@pytest.mark.parametrize("case", INT8_SCORE_CASES, ids=[f"case{i}" for i in range(len(INT8_SCORE_CASES))])
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_scores_match_float64_over_the_rounded_queries(case, threads):
    ctx, new, heads, kv_heads, head_dim, block_size = case
    gen = torch.Generator().manual_seed(sum(ctx) + head_dim * 3 + block_size)
    packed, dequant = int8_inputs(make_inputs(gen, ctx, new, heads, kv_heads, head_dim, block_size, torch.float32))
    scale = head_dim**-0.5
    got = attention_on_threads(threads, *packed, scale, int8_rows=2)
    plain = cpu_attention.paged_attention(*packed, scale)
    # a build without AVX-512 VNNI has no such path: int8_rows changes nothing there
    taken = head_dim in (64, 96, 128) and cpu_attention.int8_scores_available()
    rows = torch.repeat_interleave(torch.tensor(new) >= 2, torch.tensor(new))  # the rows of sequences it takes
    if taken:
        err = (got.double() - reference(round_queries(dequant[0], scale), *dequant[1:], scale)).abs()[rows]
        exact = (got.double() - reference(*dequant, scale)).abs()[rows]
        assert err.max().item() < 2e-5
        assert exact.mean().item() > 100 * err.mean().item()  # the rounding is real, and is what it says
        assert exact.max().item() < 0.15  # peaky random scores (q ~ 2 N(0, 1)): the rounding shows
    # decode rows (one new token) and head sizes it does not take are the float path's, bit for bit
    same = ~rows if taken else torch.ones_like(rows)
    assert torch.equal(got[same], plain[same])


def test_int8_scores_leave_windows_soft_caps_and_short_runs_to_the_float_path():
    gen = torch.Generator().manual_seed(11)
    packed, _ = int8_inputs(make_inputs(gen, [120, 40], [60, 40], 9, 3, 64, 16, torch.float32))
    if not cpu_attention.int8_scores_available():  # no VNNI path in this build: the float path throughout
        assert torch.equal(cpu_attention.paged_attention(*packed, 0.125, int8_rows=2),
                           cpu_attention.paged_attention(*packed, 0.125))
        return
    assert torch.equal(cpu_attention.paged_attention(*packed, 0.125, int8_rows=2, softcap=30.0),
                       cpu_attention.paged_attention(*packed, 0.125, softcap=30.0))
    # a window of 50: the 120-token sequence keeps the float path, the 40-token one (its window reaches
    # key 0) is plain causal attention and is taken
    got = cpu_attention.paged_attention(*packed, 0.125, int8_rows=2, window=50)
    plain = cpu_attention.paged_attention(*packed, 0.125, window=50)
    assert torch.equal(got[:60], plain[:60]) and not torch.equal(got[60:], plain[60:])
    # a window that reaches key 0 of every sequence is plain causal attention: taken
    assert not torch.equal(cpu_attention.paged_attention(*packed, 0.125, int8_rows=2, window=500),
                           cpu_attention.paged_attention(*packed, 0.125))
    # int8_rows above a sequence's new tokens: that sequence keeps the float path
    got = cpu_attention.paged_attention(*packed, 0.125, int8_rows=50)
    plain = cpu_attention.paged_attention(*packed, 0.125)
    assert torch.equal(got[60:], plain[60:]) and not torch.equal(got[:60], plain[:60])


def test_int8_scores_switch_resolves(monkeypatch):
    from hasten.kernels import cpu_features

    resolve = cpu_features.resolve_int8_attention_rows
    assert resolve("off", 16, True) == 0
    assert resolve("auto", 16, False) == 0  # another cache dtype: nothing to score in int8
    monkeypatch.setattr(cpu_attention, "int8_scores_available", lambda: True)
    assert resolve("auto", 16, True) == 16 and resolve("on", 8, False) == 8
    monkeypatch.setattr(cpu_attention, "int8_scores_available", lambda: False)
    assert resolve("auto", 16, True) == 0
    with pytest.raises(ValueError, match="AVX-512 VNNI"):
        resolve("on", 16, True)
    with pytest.raises(ValueError, match="attention_int8_scores must be one of"):
        resolve("yes", 16, True)
    with pytest.raises(ValueError, match="attention_int8_scores_min_rows must be >= 2"):
        resolve("auto", 1, True)


def test_engine_scores_prefill_chunks_in_int8(tiny_models):
    from tests.quant.wide_paths import assert_loops_agree, prompt_logprob_gap

    path = tiny_models("llama", hidden_size=128, num_heads=2, num_kv_heads=1)  # head_dim 64
    kw = dict(kv_cache_dtype="int8", num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=24)
    if not cpu_attention.int8_scores_available():  # a build without AVX-512 VNNI: auto is off, on refused
        assert LLM(path, **kw).engine.model.prefill_attention.int8_rows == 0
        with pytest.raises(ValueError, match="AVX-512 VNNI"):
            LLM(path, attention_int8_scores="on", **kw)
        return
    on = LLM(path, attention_int8_scores_min_rows=4, **kw)
    off = LLM(path, attention_int8_scores="off", **kw)
    assert on.engine.model.prefill_attention.int8_rows == 4 and off.engine.model.prefill_attention.int8_rows == 0
    assert LLM(path, **kw).engine.model.prefill_attention.int8_rows == 16  # auto, the default threshold
    assert LLM(path, num_kv_blocks=64, max_model_len=512).engine.model.prefill_attention.int8_rows == 0  # float32 cache
    # the C++ layer loop and the Python one call the kernel with the same rows: bit-identical
    assert_loops_agree(on, LLM(path, attention_int8_scores_min_rows=4, native_decoder_loop=False, **kw))
    assert 0.0 < prompt_logprob_gap(on, off) < 5e-2  # taken (the rounding shows), as close as the int8 cache itself is to float32
