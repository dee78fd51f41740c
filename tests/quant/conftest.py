"""Tiny random models for the quantization tests, and an isolated hasten cache dir."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HASTEN_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from hasten.testing import make_tiny_model

    # hidden 128 so int4 groups 32/64/128 all divide K; vocab is 384 (a multiple of 32)
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-q"), hidden_size=128, num_layers=2))
