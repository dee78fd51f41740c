from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from .fake_engine import FakeAsyncLLM, make_tokenizer
from .harness import ServerThread


@pytest.fixture(scope="session")
def fake_tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def server(fake_tokenizer) -> Iterator[ServerThread]:
    """One server on the fake engine, shared by a test module."""
    with ServerThread(lambda: FakeAsyncLLM(fake_tokenizer, max_model_len=512)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture()
def http(server: ServerThread):
    with server.client() as c:
        yield c
