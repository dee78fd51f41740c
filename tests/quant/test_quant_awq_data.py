"""ShareGPT parsing (truncated file, disjoint splits) and the AWQ scale search."""

from __future__ import annotations

import io
import json

import torch

from hasten.quant.awq import ActivationStats, search_input_scale
from hasten.quant.data import EVAL_OFFSET, iter_records
from hasten.quant.formats import fake_quantize_int4


def test_truncated_json_stops_at_last_complete_record(monkeypatch):
    import hasten.quant.data as data

    monkeypatch.setattr(data, "_CHUNK", 7)  # force records to span reads
    recs = [{"id": str(i), "conversations": [{"from": "human", "value": f"hi {i} " * 5}]} for i in range(5)]
    text = json.dumps(recs, indent=1)
    cut = text[: text.rindex('"hi 4')]  # cut inside the last record
    got = list(iter_records(io.StringIO(cut)))
    assert [c[0]["value"] for c in got] == [f"hi {i} " * 5 for i in range(4)]
    assert len(list(iter_records(io.StringIO(text), skip=2))) == 3


def test_calibration_and_evaluation_are_disjoint():
    from hasten.quant.data import calibration_texts, conversation_text, evaluation_texts, iter_conversations

    calib = {t for _, t in zip(range(3000), calibration_texts(), strict=False)}
    evals = {t for _, t in zip(range(300), evaluation_texts(), strict=False)}
    assert len(calib) > 2000 and len(evals) > 250
    assert not calib & evals
    # the raw records do repeat texts, which is why the split hashes the content
    early = [conversation_text(c) for _, c in zip(range(EVAL_OFFSET + 2000), iter_conversations(0), strict=False)]
    assert len(set(early)) < len(early)


def test_awq_search_beats_rtn_with_outlier_channels():
    torch.manual_seed(0)
    k = 128
    w = torch.randn(64, k)
    x = torch.randn(256, k)
    x[:, :4] *= 30.0  # a few salient input channels, as in real activations
    stats = ActivationStats(x.abs().sum(0), x.shape[0], [x])

    def fq(m: torch.Tensor) -> torch.Tensor:
        return fake_quantize_int4(m, 32, False)

    s, alpha, errors = search_input_scale(w, stats, fq)
    assert alpha > 0 and s is not None
    assert errors[alpha] < 0.8 * errors[0.0]
    assert min(errors.values()) == errors[alpha]


def test_collected_stats_cover_every_layer(tiny_model):
    from transformers import AutoTokenizer

    from hasten.quant.awq import collect_activation_stats
    from hasten.quant.data import calibration_chunks

    tok = AutoTokenizer.from_pretrained(tiny_model)
    chunks = calibration_chunks(tok, seq_len=64, max_tokens=256)
    assert len(chunks) == 4 and all(len(c) == 64 for c in chunks)
    stats = collect_activation_stats(__import__("pathlib").Path(tiny_model), chunks, max_samples=64)
    assert set(stats) == {f"layers.{i}.{p}" for i in range(2) for p in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")} | {"lm_head"}
    assert stats["layers.0.down_proj"].rows == 256
    assert stats["layers.0.down_proj"].sample_matrix().shape == (64, 256)
