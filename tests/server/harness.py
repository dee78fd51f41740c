"""Run the real server (uvicorn, real sockets) in a background thread for tests."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import uvicorn

from hasten.server.app import build_app


class ServerThread:
    """`with ServerThread(lambda: engine) as srv:` -> srv.url is http://127.0.0.1:PORT."""

    def __init__(self, engine_factory: Callable[[], Any], served_names: list[str] | None = None,
                 wait_ready: bool = True, supervision: Any = None) -> None:
        self.failures: list[BaseException] = []  # what the app reported as fatal (load failure, give-up)
        self.app = build_app(engine_factory, served_names, self.failures.append, supervision=supervision)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.wait_ready = wait_ready
        self.url = ""

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.server.serve())

    @property
    def state(self) -> Any:
        return self.app.state.server

    @property
    def engine(self) -> Any:
        return self.state.engine

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the server's event loop (engine state is not thread-safe)."""
        assert self.loop is not None

        async def wrapper() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result(timeout=10)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        if self.wait_ready:
            while not self.state.ready:
                if time.monotonic() > deadline:
                    raise RuntimeError("engine did not become ready")
                time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30)
