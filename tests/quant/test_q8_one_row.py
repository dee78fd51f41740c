"""quant_q8_gemm_one_row in the engine: batch-1 decode of int8-activation int4 layers on the int8 GEMM's
tiles, in the C++ layer loop and the Python one alike."""

from __future__ import annotations

import pytest

from hasten import SamplingParams
from hasten.kernels import quant_linear
from tests.quant.wide_paths import IDS, assert_loops_agree, native_and_python, small_engine

needs_kernels = pytest.mark.skipif(quant_linear.load() is None, reason="C++ kernels cannot be built here")


@needs_kernels
def test_the_cpp_loop_takes_one_row_calls_to_the_gemm_bit_identically(tiny_model):
    options = {"quant_int4_kernel": "hasten-q8", "quant_q8_gemm_one_row": "on"}
    native, python = native_and_python(small_engine, tiny_model, **options)
    assert_loops_agree(native, python)
    assert python.engine.model.layers[0].gate_up_proj.gemm_min_rows == 1


@needs_kernels
def test_one_row_on_the_gemm_decodes_as_the_dot_kernel_does(tiny_model):
    """The two one-row paths compute the same int8-activation products (float sums in another order):
    the same greedy tokens and logprobs within float32 rounding."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = {}
    for mode in ("on", "off"):
        llm = small_engine(tiny_model, quant_int4_kernel="hasten-q8", quant_q8_gemm_one_row=mode)
        assert llm.engine.model.layers[0].qkv_proj.gemm_min_rows == (1 if mode == "on" else 2)
        outs[mode] = llm.generate([IDS[:5], IDS[:11]], params)
    for a, b in zip(outs["on"], outs["off"], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-3 for t in x)


def test_bad_mode_is_refused(tiny_model):
    with pytest.raises(ValueError, match="quant_q8_gemm_one_row must be one of"):
        small_engine(tiny_model, quant_int4_kernel="hasten-q8", quant_q8_gemm_one_row="always")
