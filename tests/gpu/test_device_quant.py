"""Quantized weights on the device path, on the CPU in Triton's interpreter: the Triton int4 / int8
layers against the dequantized weight on fresh random inputs (bias and AWQ input scales included),
and the engine with quantization=int4 / int8 on the Triton path against transformers running the
same dequantized weights."""

from __future__ import annotations

import pytest
import torch

from hasten.kernels import triton as triton_kernels

pytestmark = pytest.mark.skipif(not triton_kernels.usable_on("cpu"),
                                reason="the Triton kernels run on the CPU only under TRITON_INTERPRET=1")


def _reference(qw, x: torch.Tensor) -> torch.Tensor:
    y = x.double() @ qw.dequantize().double().T
    return y + qw.bias.double() if qw.bias is not None else y


@pytest.mark.parametrize("kind", ["int4", "int4-awq", "int8", "int8-awq", "grouped-int8"])
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_device_quant_layers_match_the_dequantized_weight(kind: str, rows: int) -> None:
    from hasten.quant.formats import GroupedInt8Weight, quantize_int4, quantize_int8
    from hasten.runtime.quant_linear import DeviceQuantLayers, TritonInt4Linear, TritonInt8Linear

    g = torch.Generator().manual_seed(rows * 7 + len(kind))
    n, k = 48, 128
    w = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g)
    scale = torch.rand(k, generator=g) + 0.5 if kind.endswith("awq") else None
    if kind.startswith("int4"):
        qw = quantize_int4(w if scale is None else w * scale, 32, bias=bias, input_scale=scale)
    elif kind.startswith("int8"):
        qw = quantize_int8(w if scale is None else w * scale, bias=bias)
        qw.input_scale = scale
    else:
        codes = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
        qw = GroupedInt8Weight(codes, torch.rand(n, k // 32, generator=g), torch.randn(n, k // 32, generator=g),
                               32, bias=bias)
    layer = DeviceQuantLayers(torch.device("cpu"), torch.float32)(qw)
    expected_type = {"int4": TritonInt4Linear, "int8": TritonInt8Linear}.get(kind[:4])
    if expected_type is not None:
        assert isinstance(layer, expected_type)
    x = torch.randn(rows, k, generator=g)
    got = layer(x)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(qw, x), rtol=1e-4, atol=1e-3)
    assert layer.nbytes > 0


def _dequantized_copy(src: str, dst, mode: str) -> None:
    """The model with every projection (lm_head too) replaced by its quantize-then-dequantize weight:
    what the quantized engine computes, in transformers."""
    import transformers

    from hasten.quant.formats import quantize_int4, quantize_int8

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                w = module.weight.float()
                qw = quantize_int4(w, 32) if mode == "int4" else quantize_int8(w)
                module.weight.copy_(qw.dequantize())
    model.save_pretrained(dst)
    transformers.AutoTokenizer.from_pretrained(src).save_pretrained(dst)


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantized_engine_on_the_triton_path_matches_transformers_on_the_dequantized_weights(tmp_path, mode):
    from test_triton_engine import _hf_greedy, _prompts

    from hasten import LLM, SamplingParams
    from hasten.runtime.quant_linear import TritonInt4Linear, TritonInt8Linear
    from hasten.testing import make_tiny_model

    path = str(make_tiny_model(tmp_path / "m", arch="llama"))
    _dequantized_copy(path, tmp_path / "ref", mode)
    llm = LLM(path, attention_backend="triton", quantization=mode, num_kv_blocks=64, max_model_len=256,
              quant_cache_dir=str(tmp_path / "qcache"))
    layer_type = TritonInt4Linear if mode == "int4" else TritonInt8Linear
    assert isinstance(llm.engine.model.lm_head, layer_type)
    assert type(llm.engine.runner).__name__ == "DeviceModelRunner"
    prompts = _prompts(llm.engine.model_config.vocab_size, [5, 17, 9], seed=3)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == _hf_greedy(str(tmp_path / "ref"), prompts, 6)
