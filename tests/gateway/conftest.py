"""Fixtures for gateway tests (helpers live in gw_helpers.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from gw_helpers import Cluster
from gw_inproc import Backends


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[object]:
    """A real redis-server on a free 127.0.0.1 port, killed after the test."""
    import shutil

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not installed (apt-get install -y redis-server)")
    pytest.importorskip("redis", reason="the redis Python client is not installed (pip install redis)")
    from gov_helpers import start_redis

    server = start_redis(tmp_path)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def backends() -> AsyncIterator[Backends]:
    """Scripted in-process backends on 127.0.0.1 (gw_inproc.py), closed after the test."""
    made = Backends()
    try:
        yield made
    finally:
        await made.close()
