"""Sliding-window models hold only the blocks their windows reach: with every layer windowed (Mistral)
and the C++ attention kernel, a request's blocks behind the window are released while it runs, the
output stays token for token transformers', and a pool too small for whole sequences serves them all
without preemption."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hasten import LLM, SamplingParams
from hasten.kernels import cpu_attention
from tests.engine.conftest import hf_greedy, random_prompts

WINDOW, BLOCK = 8, 4


@pytest.fixture(scope="module")
def mistral(tiny_models):
    if cpu_attention.load() is None:
        pytest.skip("the C++ attention kernel does not build here")
    path = tiny_models("mistral", sliding_window=WINDOW)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(4, hf.config.vocab_size, seed=11, min_len=50, max_len=80)
    return path, prompts, hf_greedy(hf, prompts, 24)


def engine(path: str, **options) -> LLM:
    opts = dict(block_size=BLOCK, max_model_len=128, max_num_batched_tokens=32, attention_backend="cpp")
    return LLM(path, **{**opts, **options})


def test_blocks_behind_the_window_are_released_and_output_is_exact(mistral):
    path, prompts, ref = mistral
    # 4 sequences of up to 104 tokens need 4 x 26 blocks whole; 40 blocks only hold their windows
    llm = engine(path, num_kv_blocks=40)
    kv, scheduler = llm.engine.kv, llm.engine.scheduler
    assert kv.sliding_window == WINDOW
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert scheduler.num_preemptions == 0 and kv.window_freed_blocks > 4 * 10
    assert kv.pool.num_free == kv.pool.num_blocks  # nothing freed twice, nothing leaked
    # the same prompts again: cached blocks, early release and finishing all stay consistent
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref
    assert kv.pool.num_free == kv.pool.num_blocks


def test_switched_off_the_small_pool_preempts(mistral):
    path, prompts, ref = mistral
    llm = engine(path, num_kv_blocks=40, free_blocks_outside_window=False)
    assert llm.engine.kv.sliding_window == 0
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv.window_freed_blocks == 0


def test_not_for_models_with_a_global_layer_or_the_sdpa_path(tiny_models):
    gemma = engine(tiny_models("gemma2", sliding_window=WINDOW), num_kv_blocks=64)
    assert 0 in gemma.engine.model.windows and gemma.engine.kv.sliding_window == 0
    sdpa = engine(tiny_models("mistral", sliding_window=WINDOW), num_kv_blocks=64, attention_backend="sdpa")
    assert sdpa.engine.kv.sliding_window == 0


def test_speculative_decoding_with_early_release(mistral):
    path, prompts, ref = mistral
    llm = engine(path, num_kv_blocks=48, speculative="ngram")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert llm.engine.kv.window_freed_blocks > 0 and llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks
