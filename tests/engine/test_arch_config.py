"""Config parsing of the model families as their Hub configs state them (older and newer formats),
LongRoPE tables against transformers' own, the unsupported-architecture error and `hasten models`."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hasten.model.cli import main as models_main
from hasten.model.config import SUPPORTED_ARCHS, ModelConfig
from hasten.model.rope import RotaryEmbedding, rope_inv_freq

BASE = {"vocab_size": 1000, "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 12,
        "num_attention_heads": 4, "num_key_value_heads": 1}


def test_gemma3_hub_config_old_format():
    cfg = ModelConfig.from_hf({**BASE, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                               "head_dim": 256, "rope_theta": 1_000_000, "rope_local_base_freq": 10_000,
                               "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 512,
                               "sliding_window_pattern": 6, "query_pre_attn_scalar": 256})
    assert cfg.layer_windows == [0 if (i + 1) % 6 == 0 else 512 for i in range(12)]
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.local_rope_theta == 1e4 and cfg.local_rope_scaling is None
    assert cfg.uses_local_rope(0) and not cfg.uses_local_rope(5)
    assert cfg.attn_scale == 256**-0.5 and cfg.embed_scale == math.sqrt(1152)
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.norm_offset == 1.0 and cfg.hidden_act == "gelu_tanh"
    assert cfg.tie_word_embeddings  # Gemma's default when the config leaves it out


def test_gemma3_new_format_and_gemma2_defaults():
    cfg = ModelConfig.from_hf({**BASE, "architectures": ["Gemma3ForCausalLM"], "head_dim": 64, "sliding_window": 16,
                               "layer_types": ["sliding_attention", "full_attention"] * 6,
                               "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
                                                   "full_attention": {"rope_type": "default", "rope_theta": 9e5}}})
    assert cfg.layer_windows == [16, 0] * 6 and cfg.local_rope_theta == 500.0 and cfg.rope_theta == 9e5
    g2 = ModelConfig.from_hf({**BASE, "architectures": ["Gemma2ForCausalLM"], "sliding_window": 4096})
    assert g2.layer_windows == [4096, 0] * 6  # every other layer, the first one sliding
    assert g2.attn_softcap == 50.0 and g2.final_softcap == 30.0 and g2.head_dim == 256
    with pytest.raises(ValueError, match="bidirectional"):
        ModelConfig.from_hf({**BASE, "architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True})


def phi4_mini(**extra) -> dict:
    return {**BASE, "architectures": ["Phi3ForCausalLM"], "hidden_size": 3072, "num_attention_heads": 24,
            "num_key_value_heads": 8, "partial_rotary_factor": 0.75, "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096, "rope_theta": 10000.0, "sliding_window": 262144,
            "rope_scaling": {"type": "longrope", "short_factor": [1.0 + i / 10 for i in range(48)],
                             "long_factor": [1.0 + i for i in range(48)]}, **extra}


@pytest.mark.parametrize("kind", ["longrope", "su"])
@pytest.mark.parametrize("max_len", [4096, 8192])
def test_phi3_longrope_matches_transformers(kind, max_len):
    """Partial rotary (0.75 of 128 dims), LongRoPE factors and attention factor as transformers
    computes them: short factors while max_model_len fits the original context, long ones past it."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = phi4_mini()
    hf_cfg["rope_scaling"]["type"] = kind
    cfg = ModelConfig.from_hf(hf_cfg)
    assert cfg.rotary_dim == 96 and cfg.layer_windows == [262144] * 12
    ours, attention = rope_inv_freq(cfg.rope_spec(), max_len)
    theirs = Phi3Config(**{k: v for k, v in phi4_mini().items() if k != "architectures"})
    ref, ref_attention = ROPE_INIT_FUNCTIONS["longrope"](theirs, seq_len=max_len)
    assert torch.equal(ours, ref) and attention == ref_attention
    assert attention == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    table = RotaryEmbedding(cfg.rope_spec(), 16, torch.float32)
    assert table.cos.shape == (16, 96) and table.cos[0, 0] == pytest.approx(attention)


def test_phi3_rejects_factors_of_the_wrong_length():
    bad = phi4_mini()
    bad["rope_scaling"]["short_factor"] = [1.0] * 64
    with pytest.raises(ValueError, match="short_factor must have 48"):
        ModelConfig.from_hf(bad)


def test_granite_multipliers_and_qwen_sliding_window_switch():
    g = ModelConfig.from_hf({**BASE, "architectures": ["GraniteForCausalLM"], "embedding_multiplier": 12.0,
                             "attention_multiplier": 0.015625, "residual_multiplier": 0.22, "logits_scaling": 8.0})
    assert (g.embed_scale, g.attn_scale, g.residual_scale, g.logits_divisor) == (12.0, 0.015625, 0.22, 8.0)
    qwen = {**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32768, "max_window_layers": 8}
    assert ModelConfig.from_hf(qwen).layer_windows == []  # use_sliding_window is off by default
    on = ModelConfig.from_hf({**qwen, "use_sliding_window": True})
    assert on.layer_windows == [0] * 8 + [32768] * 4
    mistral = ModelConfig.from_hf({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert mistral.layer_windows == [4096] * 12 and mistral.window(3) == 4096


@pytest.mark.parametrize("arch", ["Qwen2MoeForCausalLM", "Gemma3ForConditionalGeneration"])
def test_unsupported_architecture_names_it_and_the_supported_list(tmp_path, arch):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "architectures": [arch]}))
    from hasten import LLM

    with pytest.raises(ValueError) as err:
        LLM(str(tmp_path))
    assert arch in str(err.value)
    assert all(name in str(err.value) for name in SUPPORTED_ARCHS)


def test_unsupported_rope_scaling_is_named():
    with pytest.raises(ValueError, match="'yarn'"):
        ModelConfig.from_hf({**BASE, "architectures": ["LlamaForCausalLM"],
                             "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_models_command(capsys):
    assert models_main(["--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [a["architecture"] for a in info["architectures"]] == list(SUPPORTED_ARCHS)
    assert info["gguf_native_block_types"] == ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"]
    assert {g["gguf"] for g in info["gguf_architectures"]} >= {"llama", "qwen2", "qwen3"}
    from hasten.cli import main

    assert main(["models"]) == 0
    text = capsys.readouterr().out
    assert "Gemma2ForCausalLM" in text and "Q8_0" in text
