"""The bfloat16 path of quantized layers (quant_bf16_gemm): wide calls multiply x in bfloat16 by a
bfloat16 copy of the dequantized weight; narrow calls keep the packed kernels. Checked layer by
layer against F.linear on the same bfloat16 operands, in the C++ layer loop against the Python
loop (bit-identical), and end to end against the same model with the switch off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hasten import LLM
from hasten.kernels import cpu_features, quant_linear
from hasten.quant.evaluate import sequence_logits
from hasten.quant.formats import GroupedInt8Weight, quantize_int4, quantize_int8
from hasten.quant.kernels import make_layer
from tests.quant.wide_paths import IDS, assert_loops_agree, native_and_python, small_engine

needs_kernels = pytest.mark.skipif(quant_linear.load() is None, reason="C++ kernels cannot be built here")


def grouped_weight(gen: torch.Generator, n: int, k: int, group: int, with_mins: bool) -> GroupedInt8Weight:
    codes = torch.randint(-32, 32, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 0.001
    mins = torch.randn(n, k // group, generator=gen) * 0.05 if with_mins else None
    return GroupedInt8Weight(codes, scales, mins, group)


def weights(gen: torch.Generator, n: int, k: int) -> dict[str, tuple[object, dict]]:
    w = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen)
    scale = torch.rand(k, generator=gen) + 0.5
    return {
        "int4 exact": (quantize_int4(w, 32, bias=bias), {"int4_kernel": "hasten"}),
        "int4 q8": (quantize_int4(w, 32), {"int4_kernel": "hasten-q8"}),
        "int4 awq": (quantize_int4(w, 32, input_scale=scale), {"int4_kernel": "hasten"}),
        "int8": (quantize_int8(w, bias), {"int8_kernel": "hasten"}),
        "int8 q8": (quantize_int8(w), {"int8_kernel": "hasten-q8"}),
        "grouped": (grouped_weight(gen, n, k, 32, False), {"int8_kernel": "hasten-q8"}),
        "grouped mins g16": (grouped_weight(gen, n, k, 16, True), {"int8_kernel": "hasten-q8"}),
    }


@needs_kernels
@pytest.mark.parametrize("name", ["int4 exact", "int4 q8", "int4 awq", "int8", "int8 q8", "grouped", "grouped mins g16"])
@pytest.mark.parametrize("n,k", [(40, 64), (72, 160)])
def test_wide_calls_multiply_in_bfloat16_narrow_calls_keep_the_kernel(name, n, k):
    gen = torch.Generator().manual_seed(n * 7 + k)
    qw, kernel = weights(gen, n, k)[name]
    plain = make_layer(qw, **kernel)
    wide = make_layer(qw, **kernel, bf16_gemm="on", bf16_gemm_min_rows=5)
    assert wide.bf16_weight is not None and wide.bf16_weight.dtype == torch.bfloat16
    assert torch.equal(wide.bf16_weight, plain.dequantize_codes().to(torch.bfloat16))
    assert wide.nbytes == plain.nbytes + n * k * 2
    for m in (1, 4):  # narrow: the packed kernel, unchanged
        x = torch.randn(m, k, generator=gen)
        assert torch.equal(wide(x), plain(x))
    for m in (5, 37):
        x = torch.randn(m, k, generator=gen)
        xs = x * plain.inv_input_scale if plain.inv_input_scale is not None else x
        want = F.linear(xs.to(torch.bfloat16), plain.dequantize_codes().to(torch.bfloat16)).float()
        if plain.bias is not None:
            want = want + plain.bias
        assert torch.equal(wide(x), want)
        # and within bfloat16 rounding of the packed kernel's own result
        ref = plain(x)
        assert torch.allclose(wide(x), ref, rtol=0.05, atol=0.05 * ref.abs().max().item())
    assert wide.calls["bf16"] == 4 and wide.calls["kernel"] == 2


def test_modes_and_validation(monkeypatch):
    resolve = cpu_features.resolve_bf16_rows
    monkeypatch.setattr(cpu_features, "cpu_has_amx", lambda: True)
    assert resolve("quant_bf16_gemm", "auto", 32) == 32
    assert resolve("quant_bf16_gemm", "auto", 32, auto_applies=False) == 0
    assert resolve("quant_bf16_gemm", "off", 32) == 0
    monkeypatch.setattr(cpu_features, "cpu_has_amx", lambda: False)
    assert resolve("quant_bf16_gemm", "auto", 32) == 0
    assert resolve("quant_bf16_gemm", "on", 8, auto_applies=False) == 8
    with pytest.raises(ValueError, match="quant_bf16_gemm must be one of"):
        resolve("quant_bf16_gemm", "fast", 32)
    with pytest.raises(ValueError, match="quant_bf16_gemm_min_rows must be >= 1"):
        resolve("quant_bf16_gemm", "on", 0)
    with pytest.raises(ValueError, match="min rows must be >= 1"):
        make_layer(quantize_int8(torch.randn(8, 32))).enable_bf16_gemm(0)


@pytest.mark.parametrize("amx", [True, False])
def test_auto_leaves_exact_layers_exact(monkeypatch, amx):
    """auto takes the bfloat16 path only for layers whose kernel rounds x anyway, and only with AMX."""
    monkeypatch.setattr(cpu_features, "cpu_has_amx", lambda: amx)
    gen = torch.Generator().manual_seed(1)
    for name, (qw, kernel) in weights(gen, 40, 64).items():
        layer = make_layer(qw, **kernel, bf16_gemm="auto")
        if not layer.use_kernel:
            continue
        assert (layer.bf16_weight is not None) == (amx and layer.rounds_activations), name
        assert layer.rounds_activations == ("q8" in name or "grouped" in name), name


def test_cpu_has_amx_agrees_with_cpuinfo():
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    expected = " amx_tile" in flags and " avx512_bf16" in flags
    assert cpu_features.cpu_has_amx() == expected


def engine(model: str, **options) -> LLM:
    return small_engine(model, **({"quant_bf16_gemm_min_rows": 6, "attention_bf16_min_rows": 6} | options))


@needs_kernels
@pytest.mark.parametrize("options", [{}, {"quant_int4_kernel": "hasten-q8"}, {"quantization": "int8"},
                                     {"quant_method": "awq"}, {"quant_bf16_gemm_silu": False},
                                     {"quant_bf16_gemm_stream": False}])
def test_the_cpp_loop_takes_the_bf16_path_bit_identically(tiny_model, options):
    """(On AMX CPUs the C++ loop's gate_up calls take SiLU from their output tiles unless
    quant_bf16_gemm_silu is off; the Python loop never does: the same bits either way.)"""
    native, python = native_and_python(engine, tiny_model, quant_bf16_gemm="on", **options)
    assert_loops_agree(native, python)
    layer = python.engine.model.layers[0].qkv_proj
    assert layer.bf16_weight is not None and layer.calls["bf16"] > 0
    assert native.engine.model.prefill_attention.bf16_rows == 6  # attention auto follows the projections


@needs_kernels
@pytest.mark.parametrize("options", [{}, {"quant_int4_kernel": "hasten-q8"}])
def test_bf16_path_adds_little_next_to_quantization(tiny_model, options):
    """bfloat16 rounding of x and of the dequantized weight moves the log-probabilities far less than
    int4 quantization itself does (measured: ~1/30 of it for exact int4, ~1/6 for int8 activations)."""
    def logprobs(llm: LLM) -> torch.Tensor:
        return torch.log_softmax(sequence_logits(llm.engine.model, IDS), -1)

    on = logprobs(engine(tiny_model, quant_bf16_gemm="on", **options))
    off_llm = engine(tiny_model, quant_bf16_gemm="off", **options)
    assert off_llm.engine.model.layers[0].qkv_proj.bf16_weight is None
    off = logprobs(off_llm)
    full = logprobs(engine(tiny_model, quantization=None))
    assert (on - off).abs().mean().item() < 0.25 * (off - full).abs().mean().item()


def test_a_bad_mode_is_a_clear_error(tiny_model):
    with pytest.raises(ValueError, match="quant_bf16_gemm must be one of"):
        engine(tiny_model, quant_bf16_gemm="always")


def test_attention_auto_follows_the_projections(tiny_model, monkeypatch):
    monkeypatch.setattr(cpu_features, "cpu_has_amx", lambda: True)
    assert engine(tiny_model, quantization=None).engine.model.prefill_attention.bf16_rows == 0  # float32 stays exact
    assert engine(tiny_model).engine.model.prefill_attention.bf16_rows == 0  # exact int4 kernel: no bfloat16 GEMM
    assert engine(tiny_model, quant_int4_kernel="hasten-q8").engine.model.prefill_attention.bf16_rows == 6
    assert engine(tiny_model, quantization=None, attention_bf16="on").engine.model.prefill_attention.bf16_rows == 6
    with pytest.raises(ValueError, match="attention_bf16 must be one of"):
        engine(tiny_model, attention_bf16="yes")
