"""`hasten serve` freezes its server process's heap once an engine is up (runtime/heap.py); an app
built inside another program (build_app's default) leaves that program's collector alone."""

from __future__ import annotations

import asyncio
import gc

import pytest

from hasten.runtime.heap import freeze_heap
from hasten.server import app as app_module
from hasten.server.app import ServerState

from .fake_engine import FakeAsyncLLM


@pytest.mark.parametrize("freeze", [True, False])
def test_server_freezes_after_load_and_restart(fake_tokenizer, monkeypatch, freeze: bool) -> None:
    calls: list[str] = []
    monkeypatch.setattr(app_module, "freeze_heap", lambda: calls.append("freeze") or 0)
    state = ServerState(lambda: FakeAsyncLLM(fake_tokenizer), None, freeze_heap_after_load=freeze)

    async def scenario() -> None:
        await state.load()
        assert state.ready
        engine = await state._build_engine()  # what the supervisor does to replace a failed engine
        await engine.shutdown()
        if state.supervisor is not None:
            await state.supervisor.stop()
        await state.engine.shutdown()

    asyncio.run(scenario())
    assert calls == (["freeze", "freeze"] if freeze else [])


def test_freeze_heap_moves_live_objects_out_of_the_scans() -> None:
    before = gc.get_freeze_count()
    keep = [[i] for i in range(1000)]  # containers the collector tracks
    try:
        assert freeze_heap() >= before + len(keep)
        scanned = {id(o) for o in gc.get_objects()}  # what a full collection walks now
        assert not any(id(x) in scanned for x in keep)
        gc.unfreeze()
        scanned = {id(o) for o in gc.get_objects()}
        assert all(id(x) in scanned for x in keep)
    finally:
        gc.unfreeze()


def test_freezing_again_collects_cycles_frozen_before() -> None:
    """A replaced engine's reference cycles were frozen with it: the next freeze_heap() frees them."""
    import weakref

    class Node:
        pass

    node = Node()
    node.self_ref = node  # a cycle: reference counting alone never frees it
    gone = weakref.ref(node)
    try:
        freeze_heap()
        del node
        gc.collect()
        assert gone() is not None  # frozen: full collections no longer see it
        freeze_heap()
        assert gone() is None
    finally:
        gc.unfreeze()
