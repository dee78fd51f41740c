"""attention_bf16_pv: in the prefill rows attention_int8_scores takes, each softmax weight times its
key's value scale is rounded to bfloat16 and P V is taken as bfloat16 dot products with the value
codes (attention_int8_scores.h). The kernel against a float64 reference with the bound that rounding
allows, the switch, and the engine with it against the engine without it."""

from __future__ import annotations

import pytest
import torch

from hasten import LLM
from hasten.kernels import cpu_attention
from tests.engine.test_attention_kernel import attention_on_threads, make_inputs, reference
from tests.engine.test_int8_kv_cache import (
    INT8_SCORE_CASES,
    int8_inputs,
    int8_prefill_engine_args,
    round_queries,
)

pytestmark = pytest.mark.skipif(cpu_attention.load() is None, reason="C++ kernels cannot be built here")


def taken_here() -> bool:
    return cpu_attention.int8_scores_available() and cpu_attention.bf16_pv_available()


@pytest.mark.parametrize("case", INT8_SCORE_CASES, ids=[f"case{i}" for i in range(len(INT8_SCORE_CASES))])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_pv_within_the_rounding_of_its_weights(case, threads):
    ctx, new, heads, kv_heads, head_dim, block_size = case
    gen = torch.Generator().manual_seed(sum(ctx) * 7 + head_dim + block_size + threads)
    packed, dequant = int8_inputs(make_inputs(gen, ctx, new, heads, kv_heads, head_dim, block_size, torch.float32))
    scale = head_dim**-0.5
    got = attention_on_threads(threads, *packed, scale, int8_rows=2, int8_bf16_pv=True)
    float_pv = cpu_attention.paged_attention(*packed, scale, int8_rows=2)
    plain = cpu_attention.paged_attention(*packed, scale)
    rows = torch.repeat_interleave(torch.tensor(new) >= 2, torch.tensor(new))
    taken = head_dim in (64, 96, 128) and taken_here()
    if taken:
        # against the float32 P V of the same path (q rounded alike in float32: the float64 reference's own
        # rounding of q may part from it at a half-way code, test_int8_kv_cache checks that path): each
        # weight p_j * vscale_j rounded to nearest bfloat16 (8 significant bits) is off by <= 2^-8 of it,
        # so per output |error| <= 2^-8 * sum_j p_j |v_j| / sum_j p_j (the reference over |v|), plus sums
        q = round_queries(dequant[0], scale)
        bound = 2.0**-8 * reference(q, dequant[1], dequant[2].abs(), *dequant[3:], scale) + 2e-5
        err = (got.double() - float_pv.double()).abs()[rows]
        assert (err <= bound[rows]).all(), (err - bound[rows]).max().item()
        assert err.mean().item() > 2e-5  # the rounding is real: 20x the float32 paths' own error
    # decode rows and head sizes the int8 path does not take are the float path's, bit for bit
    same = ~rows if taken else torch.ones_like(rows)
    assert torch.equal(got[same], plain[same])


def test_bf16_pv_without_int8_scores_changes_nothing():
    gen = torch.Generator().manual_seed(5)
    packed, _ = int8_inputs(make_inputs(gen, [90, 30], [90, 1], 9, 3, 64, 16, torch.float32))
    assert torch.equal(cpu_attention.paged_attention(*packed, 0.125, int8_bf16_pv=True),
                       cpu_attention.paged_attention(*packed, 0.125))


def test_bf16_pv_switch_resolves(monkeypatch):
    from hasten.kernels import cpu_features

    resolve = cpu_features.resolve_bf16_pv
    assert resolve("off", 16) is False
    monkeypatch.setattr(cpu_attention, "bf16_pv_available", lambda: True)
    assert resolve("auto", 16) is True and resolve("on", 16) is True
    assert resolve("auto", 0) is False  # no int8-scored rows: nothing for it to apply to
    monkeypatch.setattr(cpu_attention, "bf16_pv_available", lambda: False)
    assert resolve("auto", 16) is False
    with pytest.raises(ValueError, match="AVX512-BF16"):
        resolve("on", 16)
    with pytest.raises(ValueError, match="attention_bf16_pv must be one of"):
        resolve("bf16", 16)


def test_engine_with_bf16_pv_stays_close_to_float_pv(tiny_models):
    from tests.quant.wide_paths import assert_loops_agree, prompt_logprob_gap

    path, kw = int8_prefill_engine_args(tiny_models)
    if not taken_here():  # a build without the path: auto is off, on refused
        assert LLM(path, **kw).engine.model.prefill_attention.bf16_pv is False
        if cpu_attention.int8_scores_available():
            with pytest.raises(ValueError, match="AVX512-BF16"):
                LLM(path, attention_bf16_pv="on", **kw)
        return
    on = LLM(path, **kw)  # auto
    off = LLM(path, attention_bf16_pv="off", **kw)
    assert on.engine.model.prefill_attention.bf16_pv is True and off.engine.model.prefill_attention.bf16_pv is False
    # without int8 scores there is nothing for it to apply to
    assert LLM(path, attention_int8_scores="off", **kw).engine.model.prefill_attention.bf16_pv is False
    # the C++ layer loop and the Python one call the kernel alike: bit-identical
    assert_loops_agree(on, LLM(path, native_decoder_loop=False, **kw))
    assert 0.0 < prompt_logprob_gap(on, off) < 3e-2  # taken (the rounding shows), inside the int8 cache's own error (5e-2)
