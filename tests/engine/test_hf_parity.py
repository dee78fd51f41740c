"""Every model path against Hugging Face transformers: greedy tokens equal, prompt logprobs close."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hasten import LLM, SamplingParams
from hasten.kernels import cpu_attention
from tests.engine.conftest import hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

VARIANTS = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "num_kv_heads": 1}),
    (
        "llama",
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    ),
    ("mistral", {}),
    ("qwen2", {}),
    ("qwen3", {}),
]


@pytest.mark.parametrize("backend", ["cpp", "sdpa"])  # sdpa runs with the PyTorch glue (fused ops off)
@pytest.mark.parametrize("arch,kwargs", VARIANTS, ids=[f"{a}-{i}" for i, (a, _) in enumerate(VARIANTS)])
def test_greedy_matches_transformers(tiny_models, arch, kwargs, backend):
    if backend == "cpp" and cpu_attention.load() is None:
        pytest.skip("C++ kernel cannot be built here")
    path = tiny_models(arch, **kwargs)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(16, hf.config.vocab_size, seed=3, max_len=150)
    ref = hf_greedy(hf, prompts, GREEDY.max_tokens)
    llm = LLM(path, num_kv_blocks=512, max_model_len=1024, max_num_batched_tokens=96, attention_backend=backend,
              fused_decoder_ops=backend == "cpp")
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert batched == ref
    one_by_one = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    assert one_by_one == ref


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_prompt_logprobs_match_transformers(tiny_models, arch):
    path = tiny_models(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(4, hf.config.vocab_size, seed=5, min_len=20, max_len=200)
    llm = LLM(path, num_kv_blocks=512, max_model_len=1024, max_num_batched_tokens=64)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=3, temperature=0))
    for p, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            logp = hf(torch.tensor([p])).logits[0].log_softmax(-1)
        assert out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(p)
        for i in range(1, len(p)):
            got = out.prompt_logprobs[i]
            assert abs(got[p[i]] - logp[i - 1, p[i]].item()) < 1e-3
            top = logp[i - 1].topk(3)
            for v, t in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                assert abs(got[t] - v) < 1e-3


@pytest.mark.parametrize("backend", ["cpp", "sdpa"])
def test_float16_kv_cache_stays_close_to_transformers(tiny_models, backend):
    """kv_cache_dtype="float16" (half the KV bytes): prompt logprobs within 2e-2 of transformers',
    greedy continuations equal to the float32 cache's on most prompts."""
    if backend == "cpp" and cpu_attention.load() is None:
        pytest.skip("C++ kernel cannot be built here")
    path = tiny_models("llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(4, hf.config.vocab_size, seed=9, min_len=20, max_len=120)
    opts = dict(num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=64, attention_backend=backend,
                fused_decoder_ops=backend == "cpp")
    llm = LLM(path, kv_cache_dtype="float16", **opts)
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.float16
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0))
    for p, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            logp = hf(torch.tensor([p])).logits[0].log_softmax(-1)
        for i in range(1, len(p)):
            assert abs(out.prompt_logprobs[i][p[i]] - logp[i - 1, p[i]].item()) < 2e-2
    ref = hf_greedy(hf, prompts, 16)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))]
    assert sum(g == r for g, r in zip(got, ref, strict=True)) >= 3


def test_sample_logprobs_match_transformers(tiny_models):
    path = tiny_models("llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = random_prompts(1, hf.config.vocab_size, seed=9, min_len=30, max_len=31)[0]
    llm = LLM(path, num_kv_blocks=256, max_model_len=512)
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, logprobs=2, ignore_eos=True))[0]
    toks = out.outputs[0].token_ids
    with torch.no_grad():
        logp = hf(torch.tensor([prompt + toks])).logits[0].log_softmax(-1)
    for i, (t, lp) in enumerate(zip(toks, out.outputs[0].logprobs, strict=True)):
        ref = logp[len(prompt) - 1 + i]
        assert abs(lp[t] - ref[t].item()) < 1e-3
        assert len(lp) in (2, 3)
    assert abs(out.outputs[0].cumulative_logprob - sum(lp[t] for t, lp in zip(toks, out.outputs[0].logprobs, strict=True))) < 1e-4
