"""Engine options as the CLIs pass them (`-O KEY=VALUE`): boolean switches take true/false spellings
and refuse anything else, so that "false" never switches a feature on by being a non-empty string."""

from __future__ import annotations

import pytest

from hasten import SamplingParams
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


@pytest.mark.parametrize("field,value", [("max_num_batched_tokens", 0), ("max_num_batched_tokens", -5),
                                         ("max_num_batched_tokens", "512"), ("max_num_batched_tokens", None),
                                         ("max_num_seqs", 0), ("max_num_seqs", 2.5)])
def test_limits_that_would_schedule_nothing_are_refused(field, value):
    from hasten.engine.scheduler import SchedulerConfig

    with pytest.raises(ValueError, match=f"{field} must be a positive integer"):
        SchedulerConfig(**{field: value})


def test_unchunked_prefill_needs_a_budget_of_max_model_len():
    from hasten.engine.scheduler import SchedulerConfig

    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(512\) must be at least max_model_len \(1024\)"):
        SchedulerConfig(max_num_batched_tokens=512, max_model_len=1024, enable_chunked_prefill=False)
    assert SchedulerConfig(max_num_batched_tokens=1024, max_model_len=1024, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="unknown scheduling policy 'lifo'"):
        SchedulerConfig(policy="lifo")


def test_engine_refuses_budgets_that_would_hang(tiny_models):
    """A budget of 0 scheduled nothing and a prompt longer than the budget with chunked prefill off never
    fitted a step: generate() waited forever. Both are refused when the engine is built."""
    from hasten import LLM

    path = tiny_models("llama")
    with pytest.raises(ValueError, match="max_num_batched_tokens must be a positive integer, not 0"):
        LLM(path, num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=0)
    with pytest.raises(ValueError, match=r"must be at least max_model_len \(256\)"):
        LLM(path, num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32, enable_chunked_prefill=False)
    llm = LLM(path, num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=256, enable_chunked_prefill=False)
    assert len(llm.generate([[5] * 200], SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("option,value,message", [
    ("block_size", 0, "block_size must be a positive integer, not 0"),
    ("block_size", -16, "block_size must be a positive integer, not -16"),
    ("max_waiting_requests", 0, "max_waiting_requests must be a positive integer, not 0"),
    ("max_model_len", -4, "max_model_len must be a positive integer or None, not -4"),
    ("max_model_len", "1024", "max_model_len must be a positive integer or None, not '1024'"),
    ("num_kv_blocks", 0, "num_kv_blocks must be a positive integer or None, not 0"),
    ("num_threads", -1, "num_threads must be a positive integer or None, not -1"),
    ("kv_cache_memory_gb", 0, r"kv_cache_memory_gb must be a number in \(0, inf\], not 0"),
    ("gpu_memory_utilization", 1.5, r"gpu_memory_utilization must be a number in \(0, 1\], not 1.5"),
    ("gpu_memory_utilization", True, r"gpu_memory_utilization must be a number in \(0, 1\], not True"),
    ("distributed_timeout_s", -1.0, r"distributed_timeout_s must be a number in \(0, inf\], not -1.0"),
    # these were taken silently (no speculation, a negative threshold acting as 0) or failed later in torch
    ("num_speculative_tokens", 0, "num_speculative_tokens must be an integer >= 1, not 0"),
    ("ngram_min", 0, "ngram_min must be an integer >= 1, not 0"),
    ("quant_kernel_max_rows", -5, "quant_kernel_max_rows must be an integer >= 0, not -5"),
    ("quant_q8_gemm_x_panel", -1, "quant_q8_gemm_x_panel must be an integer >= 0, not -1"),
    ("quant_u8_gemm_x_runs", 0, "quant_u8_gemm_x_runs must be an integer between 1 and 8, not 0"),
    ("quant_u8_gemm_min_rows", -3, "quant_u8_gemm_min_rows must be an integer >= 1, not -3"),
    ("attention_prefix_group", "x", "attention_prefix_group must be an integer >= 0, not 'x'"),
    ("cuda_graph_max_batch", 2.5, "cuda_graph_max_batch must be an integer >= 1, not 2.5"),
    ("tensor_parallel_size", 0, "tensor_parallel_size must be an integer >= 1, not 0"),
    ("seed", "a", "seed must be an integer between"),
    ("seed", True, "seed must be an integer between"),
])
def test_sizes_out_of_range_are_refused_before_a_model_loads(option, value, message):
    """block_size 0 failed with a ZeroDivisionError, a negative max_model_len or num_threads with a tensor
    or torch error, max_waiting_requests 0 refused every request: now each is named when configured."""
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_options(**{option: value})


def test_sizes_in_range_pass():
    config = EngineConfig.from_options(block_size=3, max_model_len=10, num_kv_blocks=1, num_threads=1,
                                       kv_cache_memory_gb=0.25, gpu_memory_utilization=1.0, max_waiting_requests=1)
    assert (config.block_size, config.max_model_len, config.gpu_memory_utilization) == (3, 10, 1.0)
    config = EngineConfig.from_options(num_speculative_tokens=1, ngram_min=3, ngram_max=3, quant_kernel_max_rows=0,
                                       quant_q8_gemm_x_panel=0, quant_u8_gemm_x_runs=8, attention_prefix_group=0,
                                       seed=-7)
    assert (config.ngram_max, config.quant_u8_gemm_x_runs, config.seed) == (3, 8, -7)


def test_ngram_max_below_ngram_min_is_refused():
    with pytest.raises(ValueError, match=r"ngram_max \(2\) must not be below ngram_min \(5\)"):
        EngineConfig.from_options(ngram_min=5, ngram_max=2)
