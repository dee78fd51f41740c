"""The C++ layer loop (native_decoder_loop) against the Python loop: bit-identical logits and tokens."""

from __future__ import annotations

import pytest

from hasten import LLM, SamplingParams
from hasten.quant.evaluate import sequence_logits
from tests.engine.conftest import random_prompts

torch = pytest.importorskip("torch")

IDS = [5, 17, 42, 99, 7, 250, 31, 8, 64, 12, 3, 77, 140, 2, 9, 33, 18]


def pair(model: str, **options) -> tuple[LLM, LLM]:
    kw = dict(num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=16, **options)
    native, python = LLM(model, **kw), LLM(model, native_decoder_loop=False, **kw)
    if native.engine.model.loop is None:
        pytest.skip("the C++ kernels do not build here")
    assert python.engine.model.loop is None
    return native, python


def assert_same(native: LLM, python: LLM, vocab: int) -> None:
    a, b = sequence_logits(native.engine.model, IDS), sequence_logits(python.engine.model, IDS)
    assert torch.equal(a, b)
    # a mixed batch: chunked prefills (budget 16) beside decodes, several sequences per step
    prompts = random_prompts(5, vocab, seed=3, max_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    for x, y in zip(native.generate(prompts, params), python.generate(prompts, params), strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].logprobs == y.outputs[0].logprobs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("backend", ["auto", "torch", "hasten"])
def test_float_models(tiny_models, arch, backend):
    """qkv bias (Qwen2), q/k norms (Qwen3); oneDNN layers (auto) are called back in Python, plain
    (torch) and tiled (hasten) layers run natively."""
    native, python = pair(tiny_models(arch), cpu_linear_backend=backend)
    assert_same(native, python, native.engine.model_config.vocab_size)


@pytest.mark.parametrize(
    "options",
    [
        {"quantization": "int8"},
        {"quantization": "int4"},
        {"quantization": "int4", "quant_int4_kernel": "hasten-q8", "quant_group_size": 64},
        {"quantization": "int4", "quant_method": "awq"},  # per-channel input scales
        {"quantization": "int4", "quant_int4_kernel": "torch"},  # aten int4pack: a Python call-back
        {"quantization": "int8", "kv_cache_dtype": "float16"},
    ],
)
def test_quantized_models(tiny_models, tmp_path, monkeypatch, options):
    monkeypatch.setenv("HASTEN_CACHE_DIR", str(tmp_path / "cache"))
    native, python = pair(tiny_models("llama", hidden_size=128, num_layers=2), **options)
    assert_same(native, python, native.engine.model_config.vocab_size)


def test_loop_only_where_it_applies(tiny_models):
    model = tiny_models("llama")
    assert LLM(model, dtype="bfloat16").engine.model.loop is None  # float32 activations only
    sdpa = LLM(model, attention_backend="sdpa")
    out = sdpa.generate([IDS], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4  # the padded SDPA metadata takes the Python loop


def test_profiling_counts_every_part(tiny_models):
    llm = LLM(tiny_models("llama"), num_kv_blocks=64, max_model_len=256)
    loop = llm.engine.model.loop
    if loop is None:
        pytest.skip("the C++ kernels do not build here")
    loop.set_profiling(True)
    llm.generate([IDS], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    t = loop.timings()
    assert t.pop("calls") == 3  # one prefill, two decode steps
    assert set(t) == {"qkv_proj", "rope_and_cache", "paged_attention", "o_proj", "gate_up_proj", "silu_mul",
                      "down_proj", "norms"}
    assert all(v > 0 for v in t.values())
    loop.set_profiling(False)
    assert loop.timings()["calls"] == 0


def test_bad_linear_kind_is_refused():
    from hasten.kernels import quant_linear

    mod = quant_linear.load()
    if mod is None:
        pytest.skip("the C++ kernels do not build here")
    with pytest.raises(RuntimeError, match="unknown linear kind"):
        mod.make_linear("int3", [])
    with pytest.raises(RuntimeError, match="takes 3 tensors"):
        mod.make_linear("int4", [torch.zeros(2)])


def test_fast_silu_only_where_the_down_projection_rounds(tiny_models, tmp_path, monkeypatch):
    """fast_silu (on by default) leaves float32 models bit-exact; int8-activation layers take the
    vectorized exp in both loops alike (test_quantized_models). Its ~1e-6 relative change can flip an
    activation's int8 rounding, so the logits move: by less than half of what int8 activations
    themselves move them (against the same int4 weights with float32 x)."""
    monkeypatch.setenv("HASTEN_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_models("llama", hidden_size=128, num_layers=2)
    kw = dict(num_kv_blocks=256, max_model_len=512)
    on, off = LLM(model, **kw), LLM(model, fast_silu=False, **kw)
    assert on.engine.model.fast_silu and not off.engine.model.fast_silu
    assert torch.equal(sequence_logits(on.engine.model, IDS), sequence_logits(off.engine.model, IDS))
    q8 = dict(quantization="int4", quant_int4_kernel="hasten-q8", **kw)
    on, off = LLM(model, **q8), LLM(model, fast_silu=False, **q8)
    assert on.engine.model.layers[0].down_proj.rounds_activations
    a, b = sequence_logits(on.engine.model, IDS), sequence_logits(off.engine.model, IDS)
    float_x = sequence_logits(LLM(model, **{**q8, "quant_int4_kernel": "hasten"}).engine.model, IDS)
    assert 0 < (b - float_x).abs().max() and (a - b).abs().max() < 0.5 * (b - float_x).abs().max()


def test_wide_tile_rows_option_is_checked(tiny_models):
    """quant_q8_gemm_wide_rows is refused below 0 with the option's name, before any layer is built."""
    with pytest.raises(ValueError, match="quant_q8_gemm_wide_rows must be an integer >= 0"):
        LLM(tiny_models("llama"), quant_q8_gemm_wide_rows=-1, num_kv_blocks=64)
