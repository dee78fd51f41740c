"""Tiny random models in real HF format, shared per test session."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    from hasten.testing import make_tiny_model

    cache: dict[str, str] = {}

    def get(arch: str = "llama", **kwargs) -> str:
        key = arch + repr(sorted(kwargs.items()))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = str(make_tiny_model(path, arch=arch, **kwargs))
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny_llm(tiny_models):
    """One engine on the tiny Llama, reused by tests that do not change engine options."""
    from hasten import LLM

    return LLM(tiny_models("llama"), num_kv_blocks=512, max_model_len=1024, max_num_batched_tokens=128)


def random_prompts(n: int, vocab: int, seed: int = 1, min_len: int = 1, max_len: int = 120) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (n_,), generator=g).tolist() for n_ in lens]


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = model.generate(
            torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        out.append(ids[0, len(p) :].tolist())
    return out
