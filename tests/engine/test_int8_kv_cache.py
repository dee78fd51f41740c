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
