"""attention_amx: the prefill rows attention_int8_scores takes with attention_bf16_pv, on AMX tiles
(attention_amx.h: TDPBUSD scores over the packed key codes, TDPBF16PS P V over the value pairs). The
scores and bfloat16 weights are the bf16_pv path's; only the order of the float32 P V sums differs.
The kernel against that path and a float64 reference, the switch, and the engine with it."""

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

CASES = INT8_SCORE_CASES + [
    ([300, 40, 700], [300, 1, 100], 9, 3, 64, 16),  # odd unit counts (19, 44 units), decode beside chunks
    ([520, 33], [257, 33], 8, 2, 128, 16),  # head_dim 128 past one 256-key chunk, 4 query heads per kv head
    ([17, 48], [17, 48], 3, 1, 64, 16),  # MHA-like G 3 with one kv head; 17 keys: a unit of one key
]


def taken_here() -> bool:
    return cpu_attention.amx_attention_available()


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
@pytest.mark.parametrize("threads", [1, 2])
def test_tiles_match_the_bf16_pv_path(case, threads):
    ctx, new, heads, kv_heads, head_dim, block_size = case
    gen = torch.Generator().manual_seed(sum(ctx) * 11 + head_dim + block_size + threads)
    packed, dequant = int8_inputs(make_inputs(gen, ctx, new, heads, kv_heads, head_dim, block_size, torch.float32))
    scale = head_dim**-0.5
    got = attention_on_threads(threads, *packed, scale, int8_rows=2, int8_bf16_pv=True, int8_tiles=True)
    bf16_pv = cpu_attention.paged_attention(*packed, scale, int8_rows=2, int8_bf16_pv=True)
    rows = torch.repeat_interleave(torch.tensor(new) >= 2, torch.tensor(new))
    if taken_here() and head_dim in (64, 128):
        # the same bfloat16 weights and value codes, summed in another order: a float32 sum of n terms is
        # within n * 2^-24 of sum |term| either way (the reference over |v| bounds that per output)
        q = round_queries(dequant[0], scale)
        keys = torch.repeat_interleave(torch.tensor(ctx, dtype=torch.float64), torch.tensor(new))[:, None]
        magnitude = reference(q, dequant[1], dequant[2].abs(), *dequant[3:], scale)
        bound = 2 * keys * 2.0**-24 * magnitude + 1e-6
        err = (got.double() - bf16_pv.double()).abs()
        assert (err[rows] <= bound[rows]).all(), (err - bound)[rows].max().item()
        # and against float64 attention with the bf16_pv test's bound for its rounded weights
        ref = reference(q, *dequant[1:], scale)
        assert ((got.double() - ref).abs()[rows] <= (2.0**-8 * 1.01) * magnitude[rows] + 1e-4).all()
    else:  # no tiles here (or a head size they do not take): the bf16_pv path, bit for bit
        assert torch.equal(got[rows], bf16_pv[rows])
    plain = cpu_attention.paged_attention(*packed, scale)
    assert torch.equal(got[~rows], plain[~rows])  # decode rows keep the float path


def test_tiles_without_int8_scores_change_nothing():
    gen = torch.Generator().manual_seed(5)
    packed, _ = int8_inputs(make_inputs(gen, [90, 30], [90, 1], 9, 3, 64, 16, torch.float32))
    assert torch.equal(cpu_attention.paged_attention(*packed, 0.125, int8_bf16_pv=True, int8_tiles=True),
                       cpu_attention.paged_attention(*packed, 0.125))


def test_amx_switch_resolves(monkeypatch):
    from hasten.kernels import cpu_features

    resolve = cpu_features.resolve_amx_attention
    assert resolve("off", True) is False
    monkeypatch.setattr(cpu_attention, "amx_attention_available", lambda: True)
    assert resolve("auto", True) is True and resolve("on", True) is True
    assert resolve("auto", False) is False  # no bfloat16 P V (or no int8-scored rows): nothing to apply to
    monkeypatch.setattr(cpu_attention, "amx_attention_available", lambda: False)
    assert resolve("auto", True) is False
    with pytest.raises(ValueError, match="AMX-INT8"):
        resolve("on", True)
    with pytest.raises(ValueError, match="attention_amx must be one of"):
        resolve("tiles", True)


def test_engine_with_tiles_stays_with_the_bf16_pv_path(tiny_models):
    from tests.quant.wide_paths import assert_loops_agree, prompt_logprob_gap

    path, kw = int8_prefill_engine_args(tiny_models)
    if not taken_here():  # a CPU or build without the tiles: auto is off, on refused
        assert LLM(path, **kw).engine.model.prefill_attention.amx is False
        with pytest.raises(ValueError, match="AMX-INT8"):
            LLM(path, attention_amx="on", **kw)
        return
    on = LLM(path, **kw)  # auto
    off = LLM(path, attention_amx="off", **kw)
    assert on.engine.model.prefill_attention.amx is True and off.engine.model.prefill_attention.amx is False
    # the tiles' P V is bfloat16: without attention_bf16_pv there is nothing for them to take
    assert LLM(path, attention_bf16_pv="off", **kw).engine.model.prefill_attention.amx is False
    # the C++ layer loop and the Python one call the kernel alike: bit-identical
    assert_loops_agree(on, LLM(path, native_decoder_loop=False, **kw))
    assert prompt_logprob_gap(on, off) < 1e-4  # the same weights, float32 sums in another order
