"""Shared by the tests of the quantized layers' wide-call paths (quant_bf16_gemm, quant_u8_gemm): prompt
ids, a small engine over the tiny model, the same engine with the C++ and with the Python layer loop, and
the check that the two loops match."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from hasten import LLM, SamplingParams
from hasten.quant.evaluate import sequence_logits

IDS = [5, 17, 42, 99, 7, 250, 31, 8, 64, 12, 3, 77, 140, 2, 9, 33, 18, 200, 44, 61]


def small_engine(model: str, **options) -> LLM:
    """An int4 engine with a 24-token step budget: prompts of IDS prefill in chunks beside decodes."""
    kw = dict(num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=24, quantization="int4")
    kw.update(options)
    return LLM(model, **kw)


def native_and_python(build: Callable[..., LLM], model: str, **options) -> tuple[LLM, LLM]:
    """`build(model, **options)` with the C++ layer loop and with the Python loop (the test skips where
    the C++ loop does not build)."""
    native = build(model, **options)
    python = build(model, native_decoder_loop=False, **options)
    if native.engine.model.loop is None:
        pytest.skip("the C++ layer loop does not build here")
    return native, python


def assert_loops_agree(native: LLM, python: LLM) -> None:
    """Bit-identical logits of IDS, then identical greedy tokens and logprobs for decodes (narrow calls)
    beside chunked prefills (wide calls)."""
    assert torch.equal(sequence_logits(native.engine.model, IDS), sequence_logits(python.engine.model, IDS))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    prompts = [IDS[:n] for n in (3, 9, 20)]
    for a, b in zip(native.generate(prompts, params), python.generate(prompts, params), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def prompt_logprob_gap(a: LLM, b: LLM) -> float:
    """The largest difference between two engines' prompt logprobs of the actual tokens, over prompts
    of IDS long enough for several prefill chunks."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0)
    prompts = [IDS * 3, IDS[:13] * 2]
    worst = 0.0
    for x, y in zip(a.generate(prompts, params), b.generate(prompts, params), strict=True):
        for i in range(1, len(x.prompt_token_ids)):
            tok = x.prompt_token_ids[i]
            worst = max(worst, abs(x.prompt_logprobs[i][tok] - y.prompt_logprobs[i][tok]))
    return worst
