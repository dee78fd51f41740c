"""GGUF Q4_0 / Q4_1 / Q8_0 blocks read straight into our layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from hasten.quant.formats import quantize_int4  # noqa: E402
from hasten.quant.gguf_blocks import q4_blocks_to_int4, q8_blocks_to_int8  # noqa: E402
from hasten.quant.kernels import Int4HastenLinear, Int4Linear, Int8Linear  # noqa: E402

pytestmark = pytest.mark.slow  # starts processes or loads the embedded model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture
def weight() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((96, 192)).astype(np.float32) * 0.05


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q4_blocks_map_exactly_onto_int4(weight, kind):
    blocks = quantize(weight, T[kind])
    ggml = torch.from_numpy(dequantize(blocks, T[kind]).astype(np.float32))
    qw = q4_blocks_to_int4(blocks, kind, 96, 192)
    assert qw.group_size == 32
    # our layout stores d and m in float32: the dequantized values are the same numbers
    torch.testing.assert_close(qw.dequantize(), ggml, rtol=0, atol=1e-6)


def test_q4_1_layer_equals_dequantize_then_requantize(weight):
    blocks = quantize(weight, T.Q4_1)
    ggml = torch.from_numpy(dequantize(blocks, T.Q4_1).astype(np.float32))
    native = Int4Linear(q4_blocks_to_int4(blocks, "Q4_1", 96, 192))
    requant = Int4Linear(quantize_int4(ggml, 32, symmetric=False))
    x = torch.randn(4, 192)
    ref = x @ ggml.t()
    # both are within bf16-scale rounding of the GGUF weights; the native path needs no float pass
    assert rel_err(native(x), ref) < 0.01
    assert rel_err(native(x), requant(x)) < 0.03
    for path_rows in (0, 64):  # dequantize path and kernel path
        native.max_kernel_rows = path_rows
        assert rel_err(native(x), ref) < 0.01


def test_q8_0_requantized_per_channel_within_bound(weight):
    blocks = quantize(weight, T.Q8_0)
    ggml = torch.from_numpy(dequantize(blocks, T.Q8_0).astype(np.float32))
    qw = q8_blocks_to_int8(blocks, 96, 192)
    assert rel_err(qw.dequantize(), ggml) < 0.01
    x = torch.randn(3, 192)
    assert rel_err(Int8Linear(qw)(x), x @ ggml.t()) < 0.015


def test_default_gguf_layers_match_the_file():
    """The shipped SmolLM2 Q4_1 GGUF: fused, un-permuted qkv equals the file's blocks dequantized."""
    from hasten.model.gguf_convert import unpermute_rope_rows
    from hasten.model.loader import default_model_path
    from hasten.quant.gguf_blocks import GGUFLinearFactory

    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    factory = GGUFLinearFactory(path)
    parts = []
    for name, heads in (("attn_q", 9), ("attn_k", 3), ("attn_v", None)):
        t = factory.tensors[f"blk.1.{name}.weight"]
        assert t.tensor_type.name == "Q4_1"
        arr = dequantize(t.data, t.tensor_type).astype(np.float32)
        parts.append(torch.from_numpy(unpermute_rope_rows(arr, heads) if heads else arr))
    ref = torch.cat(parts)
    layer = factory("layers.1.qkv_proj", ref, None)
    assert isinstance(layer, (Int4Linear, Int4HastenLinear)) and layer.group_size == 32
    assert factory.report["layers.1.qkv_proj"] == "Q4_1"
    assert rel_err(layer.dequantize(), ref) < 0.005
    # auto runs a GGUF's int4 blocks with int8 activations (llama.cpp's scheme for the format);
    # hasten's own int4 stays exact (see INT4_AUTO)
    if isinstance(layer, Int4HastenLinear):
        assert layer.int8_activations
        exact = GGUFLinearFactory(path, int4_kernel="hasten")("layers.1.qkv_proj", ref, None)
        assert not exact.int8_activations
