"""Gemma 2, Gemma 3, Phi-3 (LongRoPE, partial rotary), Granite and sliding-window Mistral against
transformers: tiny random models in their real HF format, prompts longer than the sliding window,
chunked prefill (windows cross chunk boundaries), both attention backends."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hasten import LLM, SamplingParams
from hasten.kernels import cpu_attention
from tests.engine.conftest import hf_greedy, random_prompts


def longrope(n: int) -> dict:
    return {"type": "longrope", "short_factor": [1.0 + 0.3 * i for i in range(n)],
            "long_factor": [2.0 + 1.5 * i for i in range(n)]}


PHI3 = {"original_max_position_embeddings": 128, "max_position_embeddings": 512}
MODELS = {
    # Gemma 2 with small soft caps, so that both bend the scores / logits of a tiny model
    "gemma2": dict(sliding_window=8, config_overrides={"query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0,
                                                       "final_logit_softcapping": 3.0}),
    "gemma3": dict(sliding_window=8, config_overrides={"query_pre_attn_scalar": 24, "rope_local_base_freq": 100.0,
                                                       "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "phi3": dict(sliding_window=12, rope_scaling=longrope(4), config_overrides={**PHI3, "partial_rotary_factor": 0.5}),
    "phi3-full-rotary": dict(sliding_window=12, rope_scaling=longrope(8), config_overrides=PHI3),
    "granite": dict(config_overrides={"embedding_multiplier": 3.0, "attention_multiplier": 0.2,
                                      "residual_multiplier": 0.5, "logits_scaling": 2.0}),
    "mistral": dict(sliding_window=8),
}
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def reference(tiny_models):
    """Per model (built once): its path, prompts (40-90 tokens), transformers' greedy continuations
    and prompt log-probabilities."""
    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in cache:
            path = tiny_models(name.split("-")[0], **MODELS[name])
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
            prompts = random_prompts(4, hf.config.vocab_size, seed=3, min_len=40, max_len=90)
            with torch.no_grad():
                logps = [hf(torch.tensor([p])).logits[0].log_softmax(-1) for p in prompts]
            cache[name] = (path, prompts, hf_greedy(hf, prompts, NEW_TOKENS), logps, hf)
        return cache[name]

    return get


def assert_prompt_logprobs_close(outs, prompts, logps, tol: float = 1e-3) -> None:
    for p, out, logp in zip(prompts, outs, logps, strict=True):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
        for i in range(1, len(p)):
            assert abs(out.prompt_logprobs[i][p[i]] - logp[i - 1, p[i]].item()) < tol, (i, p[i])


def engine(path: str, backend: str, **options) -> LLM:
    if backend == "cpp" and cpu_attention.load() is None:
        pytest.skip("C++ kernel cannot be built here")
    # phi3: max_model_len 128 = original_max_position_embeddings, so LongRoPE's short factors
    opts = dict(num_kv_blocks=128, max_model_len=128, max_num_batched_tokens=24, attention_backend=backend,
                fused_decoder_ops=backend == "cpp")
    return LLM(path, **{**opts, **options})


@pytest.mark.parametrize("backend", ["cpp", "sdpa"])  # sdpa runs with the PyTorch glue (fused ops off)
@pytest.mark.parametrize("name", list(MODELS))
def test_matches_transformers(reference, name, backend):
    path, prompts, ref, logps, _ = reference(name)
    llm = engine(path, backend)
    model = llm.engine.model
    if MODELS[name].get("sliding_window"):
        assert 0 < max(model.windows) < min(map(len, prompts))  # the window matters for every prompt
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(prompts, params)  # batched, chunked prefill (24 tokens a step)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert_prompt_logprobs_close(outs, prompts, logps)
    one_by_one = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert one_by_one == ref


@pytest.mark.parametrize("backend", ["cpp", "sdpa"])
def test_without_the_window_the_results_differ(reference, backend):
    """The sliding window is what makes the test above pass: attending to every key does not."""
    path, prompts, _, logps, _ = reference("gemma2")
    llm = engine(path, backend)
    llm.engine.model.windows = [0] * len(llm.engine.model.windows)
    outs = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    with pytest.raises(AssertionError):
        assert_prompt_logprobs_close(outs, prompts[:1], logps[:1])


def test_longrope_long_factors_past_the_original_context(reference):
    """max_model_len above original_max_position_embeddings: the long factors for every position,
    exact against transformers on prompts longer than the original context (which it then runs with
    the long factors too)."""
    path, _, _, _, hf = reference("phi3")
    prompts = random_prompts(2, hf.config.vocab_size, seed=8, min_len=140, max_len=200)
    llm = engine(path, "cpp", max_model_len=512)
    short = engine(path, "cpp")
    assert not torch.equal(llm.engine.model.rope.cos[:128], short.engine.model.rope.cos[:128])
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf, prompts, NEW_TOKENS)
    with torch.no_grad():
        logps = [hf(torch.tensor([p])).logits[0].log_softmax(-1) for p in prompts]
    assert_prompt_logprobs_close(outs, prompts, logps)


@pytest.mark.parametrize("name", ["mistral", "phi3-full-rotary"])
def test_native_loop_with_windows_is_bit_identical(tiny_models, name):
    """The C++ layer loop covers per-layer windows (and LongRoPE's scaled tables): same logits and
    tokens as the Python loop. Gemma, Granite and partial rotary run the Python loop."""
    from tests.engine.test_native_loop import assert_same, pair

    native, python = pair(tiny_models(name.split("-")[0], **MODELS[name]))
    assert max(native.engine.model.windows) > 0
    assert_same(native, python, native.engine.model_config.vocab_size)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3", "granite"])
def test_loop_left_to_python_where_it_does_not_apply(tiny_models, name):
    llm = LLM(tiny_models(name.split("-")[0], **MODELS[name]), num_kv_blocks=16, max_model_len=128)
    if llm.engine.model.ops is None:
        pytest.skip("the C++ kernels do not build here")
    assert llm.engine.model.loop is None
