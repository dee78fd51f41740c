"""Engine options as the CLIs pass them (`-O KEY=VALUE`): boolean switches take true/false spellings
and refuse anything else, so that "false" never switches a feature on by being a non-empty string."""

from __future__ import annotations

import pytest

from hasten.config import EngineConfig, as_switch, parse_option_pairs, switches_as_bools


@pytest.mark.parametrize("raw,want", [("True", True), ("False", False), ("true", True), ("false", False),
                                      ("1", True), ("0", False), ("yes", True), ("NO", False), ("on", True),
                                      ("Off", False), (" false ", False)])
def test_switch_spellings(raw, want):
    options = parse_option_pairs([f"fast_silu={raw}"])
    assert EngineConfig.from_options(**options).fast_silu is want
    assert switches_as_bools(options) == {"fast_silu": want}


@pytest.mark.parametrize("value", ["maybe", "", 2, -1, 0.5, None, [True]])
def test_other_values_are_refused(value):
    with pytest.raises(TypeError, match=r"last_layer_sampled_rows must be True or False, not"):
        EngineConfig.from_options(last_layer_sampled_rows=value)
    with pytest.raises(TypeError, match="quant_u8_gemm_pow2_x_scales must be True or False"):
        switches_as_bools({"quant_u8_gemm_pow2_x_scales": value})


def test_other_options_pass_through():
    options = {"max_num_seqs": 8, "quantization": "gguf", "attention_bf16_pv": "off", "gc_freeze": "no"}
    assert switches_as_bools(options) == options | {"gc_freeze": False}
    config = EngineConfig.from_options(**options)
    assert config.max_num_seqs == 8 and config.attention_bf16_pv == "off" and config.gc_freeze is False
    assert as_switch("x", True) is True and as_switch("x", 0) is False
