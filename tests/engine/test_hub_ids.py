"""Model ids as people type them: "org/name" resolves from the local Hugging Face cache without
network access, is served under that name, and a model missing from the cache is a clear error."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hasten import LLM, SamplingParams
from hasten.model.loader import hf_hub_cache, looks_like_hub_id, resolve_model


def cache_model(cache: Path, repo_id: str, source: str, revision: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """Lay `source`'s files out as huggingface_hub's cache does: blobs, a snapshot of links, refs/main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in Path(source).iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("../..") / "blobs" / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def test_hub_id_shapes():
    assert looks_like_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") and looks_like_hub_id("Qwen/Qwen2.5-0.5B")
    for not_an_id in ("gpt2", "./org/name", "/abs/path", "a/b/c", "org/model.gguf", "~/models", "org/"):
        assert not looks_like_hub_id(not_an_id), not_an_id


def test_cached_hub_id_loads_and_is_served_under_its_name(tiny_models, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = cache_model(cache, "tiny-org/tiny-llama", tiny_models("llama"))
    assert hf_hub_cache() == cache
    assert resolve_model("tiny-org/tiny-llama") == snapshot
    llm = LLM("tiny-org/tiny-llama", num_kv_blocks=32, max_model_len=128)
    assert llm.engine.model_name == "tiny-org/tiny-llama"
    reference = LLM(tiny_models("llama"), num_kv_blocks=32, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [[5, 9, 17, 33, 2, 41]]
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == reference.generate(prompt, params)[0].outputs[0].token_ids


def test_hub_id_missing_from_the_cache_names_the_cache(tmp_path, monkeypatch):
    cache = tmp_path / "empty-hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with pytest.raises(FileNotFoundError) as err:
        LLM("no-such-org/no-such-model")
    assert "no-such-org/no-such-model" in str(err.value) and str(cache) in str(err.value)
    assert "huggingface-cli download" in str(err.value)
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model(str(tmp_path / "missing-folder"))
