"""The engine path: LLM(quantization=...), save/load round trip, AWQ, the perplexity gate."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hasten import LLM, SamplingParams
from hasten.quant.evaluate import evaluate, sequence_logits
from hasten.quant.kernels import Int4HastenLinear, Int4Linear, Int8Linear, QuantLinear

INT4 = (Int4Linear, Int4HastenLinear)  # which one depends on quant_int4_kernel (auto: hasten when it builds)

IDS = [5, 17, 42, 99, 7, 250, 31, 8, 64, 12, 3, 77]


def make(model: str, **kw) -> LLM:
    return LLM(model, num_kv_blocks=40, max_model_len=256, **kw)


@pytest.mark.parametrize(
    "options,kind",
    [
        ({"quantization": "int8"}, Int8Linear),
        ({"quantization": "int4"}, INT4),
        ({"quantization": "int4", "quant_group_size": 128, "quant_symmetric": True}, INT4),
        ({"quantization": "int4", "dtype": "bfloat16"}, INT4),
        ({"quantization": "int4", "quant_int4_kernel": "torch"}, Int4Linear),
        ({"quantization": "int4", "quant_int4_kernel": "hasten"}, Int4HastenLinear),
    ],
)
def test_quantized_engine_generates_close_to_float(tiny_model, options, kind):
    opts = dict(options)
    dtype = opts.pop("dtype", "auto")
    ref = make(tiny_model, dtype=dtype)
    llm = make(tiny_model, dtype=dtype, **opts)
    layer = llm.engine.model.layers[0].qkv_proj
    assert isinstance(layer, kind)
    assert isinstance(llm.engine.model.lm_head, kind)
    out = llm.generate([IDS], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8
    a, b = sequence_logits(llm.engine.model, IDS), sequence_logits(ref.engine.model, IDS)
    assert a.dtype == torch.float32
    bound = 0.05 if opts["quantization"] == "int8" else 0.5  # random tiny weights: int4 noise compounds
    assert float((a - b).norm() / b.norm()) < bound
    # exact wiring: a float decoder holding the dequantized weights gives the same logits
    c = sequence_logits(dequantized_twin(llm), IDS)
    # (int8 activations, the auto int4 kernel, add their own rounding: checked exactly in test_int4_kernel)
    tol = 0.1 if getattr(layer, "int8_activations", False) else 0.03 if dtype == "bfloat16" else 0.01
    assert float((a - c).norm() / c.norm()) < tol


def dequantized_twin(llm: LLM):
    """A float Decoder whose every linear layer is the dequantized weight of `llm`'s layer."""
    from hasten.model.decoder import Decoder
    from hasten.model.linear import DenseLinear
    from hasten.model.loader import load_state_dict

    model = llm.engine.model
    layers = {"lm_head": model.lm_head}
    for i, lw in enumerate(model.layers):
        for p in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            layers[f"layers.{i}.{p}"] = getattr(lw, p)

    def factory(name, weight, bias):
        layer = layers[name]
        w = layer.dequantize() if isinstance(layer, QuantLinear) else layer.weight.float()
        return DenseLinear(w.to(weight.dtype), bias)

    state = load_state_dict(llm.engine.model_path)
    return Decoder(model.cfg, state, model.dtype, 256, factory)


def test_lm_head_can_stay_dense(tiny_model):
    llm = make(tiny_model, quantization="int8", quantize_lm_head=False)
    assert not isinstance(llm.engine.model.lm_head, QuantLinear)
    assert isinstance(llm.engine.model.layers[1].down_proj, Int8Linear)


@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_save_then_load_gives_identical_logits(tiny_model, tmp_path, monkeypatch, method):
    from hasten.quant import factory as factory_mod

    opts = dict(quantization="int4", quant_method=method, quant_cache_dir=str(tmp_path / "q"))
    first = make(tiny_model, **opts)
    files = list((tmp_path / "q").glob("*.safetensors"))
    assert len(files) == 1
    from safetensors import safe_open

    with safe_open(str(files[0]), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == "hasten-quant-v1"
    assert json.loads(meta["options"])["method"] == method
    assert json.loads(meta["layers"])["lm_head"] == {"kind": "int4", "group_size": 32}
    mtime = os.path.getmtime(files[0])

    def no_quantizing(*a, **k):
        raise AssertionError("the second start must load the saved file, not quantize")

    monkeypatch.setattr(factory_mod.QuantizingFactory, "quantize", no_quantizing)
    second = make(tiny_model, **opts)
    assert os.path.getmtime(files[0]) == mtime
    assert torch.equal(sequence_logits(first.engine.model, IDS), sequence_logits(second.engine.model, IDS))
    if method == "awq":
        scales = [lw.qkv_proj.inv_input_scale for lw in second.engine.model.layers]
        assert any(s is not None for s in scales)


def test_options_change_the_cache_file(tiny_model, tmp_path):
    d = str(tmp_path / "q")
    make(tiny_model, quantization="int4", quant_group_size=32, quant_cache_dir=d)
    make(tiny_model, quantization="int4", quant_group_size=64, quant_cache_dir=d)
    make(tiny_model, quantization="int8", quant_cache_dir=d)
    assert len(list((tmp_path / "q").glob("*.safetensors"))) == 3


def test_bad_options_are_refused(tiny_model):
    with pytest.raises(ValueError):
        make(tiny_model, quantization="int3")
    with pytest.raises(ValueError):
        make(tiny_model, quantization="int4", quant_method="gptq")
    with pytest.raises(ValueError):
        make(tiny_model, quantization="gguf")  # not converted from a GGUF: no hasten_source.json


def test_evaluate_against_itself_is_perfect(tiny_model):
    llm = make(tiny_model)
    seqs = [IDS, IDS[::-1] + IDS]
    res = evaluate(llm.engine.model, seqs, llm.engine.model)
    assert res.top1_agreement == 1.0 and res.increase == pytest.approx(0.0, abs=1e-9)
    assert res.num_tokens == len(IDS) - 1 + 2 * len(IDS) - 1
    assert 1.0 < res.perplexity < 2 * llm.engine.model_config.vocab_size
    cached = evaluate(llm.engine.model, seqs, reference_logits=[sequence_logits(llm.engine.model, s) for s in seqs])
    assert cached.top1_agreement == 1.0 and cached.perplexity == pytest.approx(res.perplexity)


def test_perplexity_gate_cli(tiny_model, capsys):
    from hasten.quant.cli import main

    common = [tiny_model, "--seq-len", "64", "--max-tokens", "256"]
    assert main(common + ["--quantization", "int8", "--max-increase", "0.05", "--min-top1", "0.8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["num_tokens"] >= 250 and report["top1_agreement"] >= 0.8
    assert abs(report["increase"]) < 0.05
    # the gate must be able to fail
    assert main(common + ["--quantization", "int4", "--min-top1", "1.01"]) == 1
    assert "FAIL" in capsys.readouterr().out
