"""GGUF K-quants and 5-/8-bit blocks served in their own arithmetic: each block type against the gguf
package's own dequantizer on fresh random blocks; the grouped int8 kernel against a float64
reference of its block arithmetic (ragged shapes, 1-2 threads; the portable and AVX2 builds run this
file again, tests/engine/test_generic_build.py); fused projections mixing types; and a tiny model
whose every projection is such blocks, greedy-equal to transformers on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from hasten.kernels import quant_linear  # noqa: E402
from hasten.quant.formats import GroupedInt8Weight  # noqa: E402
from hasten.quant.gguf_blocks import q4_blocks_to_int4, q4k_blocks_to_int4  # noqa: E402
from hasten.quant.gguf_kquants import CONVERTERS, concat_grouped  # noqa: E402
from hasten.quant.kernels import GroupedInt8Linear, make_layer  # noqa: E402
from tests.quant.gguf_helpers import dequantized, random_blocks, write_block_model  # noqa: E402
from tests.quant.test_quant_linear_kernel import q8_runs  # noqa: E402

needs_kernels = pytest.mark.skipif(quant_linear.load() is None, reason="C++ kernels unavailable")


@pytest.mark.parametrize("kind", sorted(CONVERTERS))
@pytest.mark.parametrize(("n", "k", "seed"), [(1, 256, 0), (7, 512, 1), (33, 1536, 2)])
def test_blocks_map_onto_grouped_int8_as_ggml_dequantizes(kind, n, k, seed):
    data = random_blocks(kind, n, k, np.random.default_rng(seed))
    qw = CONVERTERS[kind](data, n, k)
    assert qw.shape == (n, k) and qw.qweight.dtype == torch.int8
    assert qw.group_size == (16 if kind == "Q6_K" else 32)
    assert (qw.mins is None) == (kind in ("Q5_0", "Q6_K", "Q8_0"))  # no min term where there is none
    ref = torch.from_numpy(dequantized(kind, data, n, k)).double()
    torch.testing.assert_close(qw.dequantize().double(), ref, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(("n", "k", "seed"), [(1, 256, 0), (7, 512, 1), (33, 1536, 2)])
def test_q4k_maps_onto_int4_as_ggml_dequantizes(n, k, seed):
    data = random_blocks("Q4_K", n, k, np.random.default_rng(seed))
    reference = torch.from_numpy(dequantized("Q4_K", data, n, k)).double()
    qw = q4k_blocks_to_int4(data, n, k)
    assert qw.shape == (n, k) and qw.group_size == 32
    torch.testing.assert_close(qw.dequantize().double(), reference, rtol=1e-6, atol=1e-9)
    # with the int4 kernels' float16 scales and mins: within 2^-11 of each sub-block's scale step
    half = (qw.unpack().double().view(n, k // 32, 32) * qw.scales.half().double()[..., None]
            + qw.mins.half().double()[..., None]).view(n, k)
    step = qw.scales.double().abs().repeat_interleave(32, dim=1) * 15 + qw.mins.double().abs().repeat_interleave(32, dim=1)
    assert ((half - reference).abs() <= step * 2.0**-10 + 1e-9).all()


@needs_kernels
@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("with_mins", [False, True])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 50, 64), (3, 97, 576), (5, 8, 96), (16, 3, 32), (4, 33, 256),
                                         (13, 50, 64), (40, 97, 576), (12, 24, 96), (17, 16, 256)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("wide_rows", [0, 8])  # 8: from 8 rows of x the 16-row AVX-512 tiles
def test_grouped_int8_kernel_matches_reference(group, with_mins, m, n, k, threads, wide_rows):
    gen = torch.Generator().manual_seed(m * 131 + n * 7 + k + group)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 0.001
    mins = torch.randn(n, k // group, generator=gen) * 0.1 if with_mins else None
    x = torch.randn(m, k, generator=gen) * 3
    q[0, :4] = -128  # the extreme code (w + 128 = 0 in the AVX-512 tiles)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    quant_linear.set_q8_gemm_wide_rows(wide_rows)
    try:
        rows8 = quant_linear.int8g_pack_rows8(q, scales, mins, group)
        y = quant_linear.int8g_linear_q8_gemm(x, *rows8, group, n)
    finally:
        quant_linear.set_q8_gemm_wide_rows(8)
        torch.set_num_threads(before)
    codes = (q.double().view(n, k // group, group) * scales.double()[..., None]).view(n, k)
    want = q8_runs(x) @ codes.t()  # x rounded per 32, products exact
    if mins is not None:  # the min term uses the group sums of the rounded x
        want = want + q8_runs(x).view(m, k // group, group).sum(-1) @ mins.double().t()
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert (y.double() - want).abs().max().item() / want.abs().max().item() < 1e-5
    weight = GroupedInt8Weight(q, scales, mins, group).dequantize().double()
    exact = x.double() @ weight.t()
    assert (y.double() - exact).abs().max().item() / exact.abs().max().item() < 2e-2


@needs_kernels
def test_grouped_int8_kernel_rejects_bad_shapes():
    q = torch.zeros(8, 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="group 16 or 32"):
        quant_linear.int8g_pack_rows8(q, torch.ones(8, 1), None, 64)
    rows8 = quant_linear.int8g_pack_rows8(q, torch.ones(8, 2), None, 32)
    with pytest.raises(RuntimeError, match="must be the"):
        quant_linear.int8g_linear_q8_gemm(torch.randn(2, 64), *rows8, 16, 8)
    with pytest.raises(RuntimeError, match="x must be"):
        quant_linear.int8g_linear_q8_gemm(torch.randn(2, 64).double(), *rows8, 32, 8)


@pytest.mark.parametrize("int8_kernel", ["hasten-q8", "hasten"])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_grouped_layer_paths(int8_kernel, rows):
    """hasten-q8: the int8 GEMM at every row count; hasten: x in float32 against the dequantized weight."""
    n, k = 45, 512
    data = random_blocks("Q6_K", n, k, np.random.default_rng(rows))
    weight = torch.from_numpy(dequantized("Q6_K", data, n, k)).double()
    qw = CONVERTERS["Q6_K"](data, n, k)
    qw.bias = torch.randn(n)
    layer = make_layer(qw, int8_kernel=int8_kernel, int8_auto="hasten-q8")
    assert isinstance(layer, GroupedInt8Linear)
    kernel = int8_kernel == "hasten-q8" and quant_linear.load() is not None
    assert layer.int8_activations == kernel
    torch.testing.assert_close(layer.dequantize_codes().double(), weight, rtol=1e-6, atol=1e-9)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    ref = x.double() @ weight.t() + qw.bias.double()
    tol = 2e-2 if kernel else 1e-5  # -q8: activations rounded to int8 per 32 values
    err = (layer(x).double() - ref).abs().max() / ref.abs().max()
    assert err < tol, err
    if kernel:
        assert layer.calls["kernel"] == 1 and layer.nbytes < n * k * 2


def test_mixed_parts_concatenate_exactly():
    """A fused projection whose parts are Q5_0, Q8_0, Q4_K, Q4_0 and Q6_K rows: one grouped int8 weight
    (group 16, as Q6_K's) equal to the parts' dequantized rows stacked."""
    rng = np.random.default_rng(3)
    k = 512
    parts, refs = [], []
    for kind, n in (("Q5_0", 8), ("Q8_0", 4), ("Q4_K", 5), ("Q4_0", 3), ("Q6_K", 9), ("Q5_1", 2)):
        data = random_blocks(kind, n, k, rng)
        refs.append(torch.from_numpy(dequantized(kind, data, n, k)).double())
        if kind == "Q4_K":
            parts.append(q4k_blocks_to_int4(data, n, k))
        elif kind == "Q4_0":
            parts.append(q4_blocks_to_int4(data, kind, n, k))
        else:
            parts.append(CONVERTERS[kind](data, n, k))
    joined = concat_grouped(parts)
    assert joined.group_size == 16 and joined.mins is not None and joined.shape == (31, k)
    torch.testing.assert_close(joined.dequantize().double(), torch.cat(refs), rtol=1e-6, atol=1e-9)
    without_q6 = concat_grouped(parts[:2])
    assert without_q6.group_size == 32 and without_q6.mins is None


MIXES = {
    "Q5_0": {"*": "Q5_0"}, "Q5_1": {"*": "Q5_1"}, "Q5_K": {"*": "Q5_K"}, "Q6_K": {"*": "Q6_K"},
    "Q8_0": {"*": "Q8_0"}, "Q4_K": {"*": "Q4_K"},
    # as llama.cpp's Q4_K_M mixes them: a fused qkv of two families, down and lm_head in Q6_K
    "Q4_K_M": {"*": "Q4_K", "v_proj": "Q8_0", "down_proj": "Q6_K", "lm_head": "Q6_K", "o_proj": "Q5_0"},
}


@pytest.fixture(scope="module")
def block_models(tmp_path_factory):
    from hasten.testing import make_tiny_model

    made: dict[str, str] = {}

    def get(mix: str) -> str:
        if mix not in made:
            folder = make_tiny_model(tmp_path_factory.mktemp(f"gguf-{mix}"), hidden_size=256, num_heads=4,
                                     num_kv_heads=2)
            made[mix] = str(write_block_model(folder, MIXES[mix], seed=len(made)))
        return made[mix]

    return get


@needs_kernels
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_tiny_model_of_blocks_matches_transformers(block_models, mix):
    """Every projection from the GGUF's own blocks (no requantization reported): with float32
    activations greedy tokens equal transformers' on the dequantized weights, batched and one by
    one; with int8 activations (the GGUF default) prompt logprobs stay close."""
    import transformers

    from hasten import LLM, SamplingParams
    from tests.engine.conftest import hf_greedy, random_prompts

    folder = block_models(mix)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    prompts = random_prompts(3, hf.config.vocab_size, seed=5, min_len=4, max_len=40)
    with torch.no_grad():
        want = hf_greedy(hf, prompts, 12)
    exact = LLM(folder, quantization="gguf", quant_int8_kernel="hasten", quant_int4_kernel="hasten",
                num_kv_blocks=128, max_model_len=256)
    kinds = {type(layer).__name__ for lw in exact.engine.model.layers
             for layer in (lw.qkv_proj, lw.o_proj, lw.gate_up_proj, lw.down_proj)}
    kinds.add(type(exact.engine.model.lm_head).__name__)
    assert "Int8Linear" not in kinds and "DenseLinear" not in kinds, kinds  # nothing requantized or dense
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in exact.generate([list(p) for p in prompts], sp, use_tqdm=False)]
    single = [exact.generate([list(p)], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert [list(t) for t in batched] == want
    assert [list(t) for t in single] == want
    del exact
    q8 = LLM(folder, quantization="gguf", num_kv_blocks=128, max_model_len=256)
    p = prompts[0]
    with torch.no_grad():
        logp = hf(torch.tensor([p])).logits[0].double().log_softmax(-1)
    out = q8.generate([list(p)], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1), use_tqdm=False)[0]
    err = max(abs(out.prompt_logprobs[i][p[i]] - logp[i - 1, p[i]].item()) for i in range(1, len(p)))
    assert err < 0.03, err  # int8 activations: 0.004-0.016 on these models
