"""Structured output (`response_format`) by constrained decoding with xgrammar.

`await StructuredOutput.grammar(response_format)` returns the compiled `Grammar` for a
schema, and `processor(grammar)` a logits processor that the engine calls before
sampling every token of one sequence: `processor(output_token_ids, logits_row)`. It feeds
the tokens generated since its last call to an xgrammar `GrammarMatcher` and masks every
token the grammar does not allow at this point to -inf, in place. Once the JSON value is
complete only the stop token is allowed, so the output always parses and matches the
schema (unless `max_tokens` cuts it short: finish_reason="length").

Whitespace between JSON tokens is not allowed (`any_whitespace=False`): a small model
left free to emit whitespace can loop on it until max_tokens.

What a schema may cost (see `grammar_limits.py`, `grammar_worker.py`):

* the key is the schema's JSON text with its property order kept (the model writes
  properties in that order), and it is what gets compiled;
* over a size limit: 400 at once; a key that failed before (invalid, or over the compile
  timeout) fails again at once for `_FAILURE_TTL_S` seconds;
* a cache miss compiles in a worker *process*, off the event loop, under a timeout, and is
  killed when the timeout passes or every client waiting for it disconnects. Concurrent
  requests for the same key share one compile; different keys compile independently;
* compiled grammars are kept in a cache bounded by bytes. Where the engine runs (an engine
  process, or this process for an engine thread) a grammar is loaded once per key, from
  whichever the worker found cheaper: compiled again (nearly every real schema: 5-50 ms
  of CPU) or deserialized (slow compiles with a small serialized form). So what the engine
  does per new schema is bounded by what the worker measured (at most `max_recompile_s`
  of compiling, or reading at most `max_serialized_bytes`); nothing unbounded reaches it,
  since a schema goes there only after it compiled within the budget here. Why xgrammar's
  serialized form is not simply always sent: see grammar_worker.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson

from hasten.server.errors import RETRY_AFTER_SECONDS, APIError
from hasten.server.grammar_cache import ByteLRU
from hasten.server.grammar_limits import SCHEMA_PARAM, StructuredLimits, check_counts, check_size
from hasten.server.grammar_service import (
    CompilerBusy,
    CompileRejected,
    CompilerUnavailable,
    CompileService,
    CompileTimeout,
    CompileTooLarge,
)
from hasten.server.grammar_worker import JSON_OBJECT_KEY, compile_key
from hasten.server.protocol import ResponseFormat

logger = logging.getLogger("hasten.server.structured")

_FAILURE_TTL_S = 300.0  # how long a schema that failed to compile fails at once
_MAX_FAILURES = 1024  # failed keys remembered (by digest)


def tokenizer_info(tokenizer: Any) -> Any:
    """xgrammar's view of a tokenizer; the server and the engine process must build the same one."""
    import xgrammar as xg

    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
    return xg.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=stop)


class GrammarLoader:
    """Turns what a worker sent (a key, or a serialized grammar) into a CompiledGrammar in this process."""

    def __init__(self, info: Any) -> None:
        self.info = info
        self._compiler: Any = None
        self._lock = threading.Lock()
        self.compiled = 0  # grammars compiled here (the worker compiled them fast)
        self.deserialized = 0  # grammars deserialized here (the worker compiled them slowly)

    def load(self, key: str, serialized: str | None) -> Any:
        import xgrammar as xg

        if serialized is not None:
            self.deserialized += 1
            return xg.CompiledGrammar.deserialize_json(serialized, self.info)
        with self._lock:  # one at a time: each took at most max_recompile_s in the worker
            if self._compiler is None:
                self._compiler = xg.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
            self.compiled += 1
            return compile_key(self._compiler, key)


@dataclass(eq=False)
class Grammar:
    """A schema that compiled within the budget: what the engine's process needs to load it (the key,
    or the serialized grammar when it compiled slowly), and, once loaded here, the CompiledGrammar."""

    digest: str  # sha256 of the key
    key: str  # what it was compiled from (schema_text)
    serialized: str | None  # CompiledGrammar.serialize_json(), for a grammar slow to compile
    memory_bytes: int  # CompiledGrammar.memory_size_bytes
    compiled: Any = None
    error: str | None = None  # why loading it in this process failed (its requests fail alone)

    @property
    def loaded(self) -> bool:
        return self.compiled is not None or self.error is not None

    @property
    def nbytes(self) -> int:
        return len(self.key) + len(self.serialized or "") + self.memory_bytes


class GrammarLogitsProcessor:
    """Masks one sequence's logits to what its grammar allows next. Not shared between sequences."""

    def __init__(self, grammar: Grammar, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.grammar = grammar
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.matcher: Any = None  # made at the first call, where the engine runs
        self.bitmask: Any = None
        self.num_accepted = 0
        self.rejected = False  # a token the grammar did not allow was forced in (engine bug)

    def __reduce__(self) -> tuple:
        # The xgrammar matcher cannot be pickled; the receiving process (an engine process, which
        # must have called `set_process_tokenizer`) rebuilds the processor from the key or serialized grammar.
        if self.num_accepted:
            raise TypeError("a GrammarLogitsProcessor in use cannot be moved to another process")
        g = self.grammar
        return (_rebuild_processor, (g.digest, g.key if g.serialized is None else "", g.serialized))

    def ready(self) -> bool:
        """Whether the grammar is loaded (or failed to load) in this process: the engine process holds a
        request back until then, so that loading a grammar never blocks its step loop."""
        return self.grammar.loaded

    def _reset(self) -> None:
        import xgrammar as xg

        if self.grammar.compiled is None:
            raise RuntimeError(self.grammar.error or "the grammar was not loaded in this process")
        self.matcher = xg.GrammarMatcher(self.grammar.compiled)
        if self.bitmask is None:
            self.bitmask = xg.allocate_token_bitmask(1, self.vocab_size)
        self.num_accepted = 0
        self.rejected = False

    def _catch_up(self, output_token_ids: list[int]) -> None:
        if self.matcher is None or len(output_token_ids) < self.num_accepted:
            # First call, or the sequence got shorter (recomputed after preemption): from the start.
            self._reset()
        for token in output_token_ids[self.num_accepted:]:
            self.num_accepted += 1
            if self.rejected or self.matcher.is_terminated():
                continue
            if not self.matcher.accept_token(token):
                logger.warning("token %d was not allowed by the grammar", token)
                self.rejected = True

    def __call__(self, output_token_ids: list[int], logits: Any) -> None:
        import xgrammar as xg

        self._catch_up(output_token_ids)
        width = logits.shape[-1]
        n = min(width, self.vocab_size)
        if self.rejected or self.matcher.is_terminated():
            keep = logits[self.stop_token_ids[0]].item() if self.stop_token_ids else 0.0
            logits.fill_(float("-inf"))
            if self.stop_token_ids:
                logits[self.stop_token_ids[0]] = keep
            return
        self.matcher.fill_next_token_bitmask(self.bitmask)
        row = logits[:n] if n < width else logits
        if row.device.type == "cpu":
            xg.apply_token_bitmask_inplace(row, self.bitmask, vocab_size=n)
        else:
            mask = self.bitmask.to(row.device, non_blocking=True)
            xg.apply_token_bitmask_inplace(row, mask, vocab_size=n, backend="torch_native")
        if n < width:
            logits[n:] = float("-inf")  # padding rows of the model's vocab are never valid


class FailedProcessor:
    """Stands in for a processor whose grammar could not be rebuilt: fails its own request only."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __call__(self, output_token_ids: list[int], logits: Any) -> None:
        raise RuntimeError(self.message)


# ---------------------------------------------------------------------------------- server side


@dataclass
class _Flight:
    """One compile in progress and how many requests wait for it."""

    task: asyncio.Task[Grammar]
    waiters: int = 0


@dataclass
class StructuredStats:
    hits: int = 0  # grammars found in the cache
    compiles: int = 0  # compiles started (single flight: one per key at a time)
    failures: int = 0  # compiles that ended in a 400 (invalid, too slow, crashed the compiler)
    abandoned: int = 0  # compiles stopped because every waiting client went away
    loads: int = 0  # grammars loaded in this process (for an engine thread)


@dataclass
class _Failure:
    at: float
    error: APIError


class StructuredOutput:
    """Compiles (in worker processes) and caches grammars for one tokenizer; hands out processors."""

    def __init__(self, tokenizer: Any, limits: StructuredLimits | None = None) -> None:
        self.limits = limits or StructuredLimits()
        self._tokenizer = tokenizer
        self._loader: GrammarLoader | None = None
        self._loader_lock = threading.Lock()
        self.cache: ByteLRU[Grammar] = ByteLRU(self.limits.cache_bytes)
        self._failures: OrderedDict[str, _Failure] = OrderedDict()
        self._flights: dict[str, _Flight] = {}
        self.stats = StructuredStats()
        lim = self.limits
        self.service = CompileService(self._info_json, lim.max_compiles, lim.worker_recycle_bytes,
                                      lim.serialize_above_s, lim.max_serialized_bytes, lim.max_recompile_s)
        self._prestart: asyncio.Task[None] | None = None
        if self.limits.prestart:
            try:
                self._prestart = asyncio.get_running_loop().create_task(self.service.start())
                self._prestart.add_done_callback(_log_prestart)
            except RuntimeError:  # no running loop: start at the first compile
                pass

    async def prestarted(self) -> None:
        """Once the compiler process started with the server (limits.prestart) is up, or failed to
        start (logged; the first schema then tries again): building the tokenizer's xgrammar info and
        starting that process take seconds of CPU, which the first requests would otherwise share."""
        if self._prestart is not None:
            await asyncio.gather(self._prestart, return_exceptions=True)

    # ---- tokenizer info -----------------------------------------------------------------
    def info(self) -> Any:
        """Blocking the first time (~0.1 s for a 49k vocabulary)."""
        return self._grammar_loader().info

    def _grammar_loader(self) -> GrammarLoader:
        with self._loader_lock:
            if self._loader is None:
                self._loader = GrammarLoader(tokenizer_info(self._tokenizer))
            return self._loader

    def _info_json(self) -> str:
        return self.info().serialize_json()

    # ---- keys -------------------------------------------------------------------------
    def key(self, fmt: ResponseFormat) -> tuple[str, str]:
        """(key, digest): the schema's text (see `schema_text`), 400 if over --max-schema-bytes."""
        text = schema_text(fmt)
        check_size(len(text), self.limits)
        return text.decode(), hashlib.sha256(text).hexdigest()

    # ---- compiling ----------------------------------------------------------------------
    def cached(self, fmt: ResponseFormat) -> Grammar | None:
        """The grammar if it is in the cache (no I/O, no waiting)."""
        grammar = self.cache.get(self.key(fmt)[1])
        if grammar is not None:
            self.stats.hits += 1
        return grammar

    async def grammar(self, fmt: ResponseFormat) -> Grammar:
        """The compiled grammar for `fmt`: from the cache, or compiled once however many ask."""
        key, digest = self.key(fmt)
        grammar = self.cache.get(digest)
        if grammar is not None:
            self.stats.hits += 1
            return grammar
        self._raise_known_failure(digest)
        if fmt.json_schema is not None and key != JSON_OBJECT_KEY:
            check_counts(fmt.json_schema.schema_, self.limits)
        flight = self._flights.get(digest)
        if flight is None:
            flight = _Flight(asyncio.ensure_future(self._compile(key, digest)))
            self._flights[digest] = flight
            flight.task.add_done_callback(lambda task: self._landed(digest, task))
            self.stats.compiles += 1
        flight.waiters += 1
        try:
            return await asyncio.shield(flight.task)
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.task.done():
                # Nobody wants it any more: the worker is killed, and a later request compiles afresh.
                if self._flights.get(digest) is flight:
                    del self._flights[digest]
                flight.task.cancel()
                self.stats.abandoned += 1

    def _landed(self, digest: str, task: asyncio.Task[Grammar]) -> None:
        flight = self._flights.get(digest)
        if flight is not None and flight.task is task:
            del self._flights[digest]
        if not task.cancelled():
            task.exception()  # retrieved: waiters that left do not need it

    async def _compile(self, key: str, digest: str) -> Grammar:
        param = SCHEMA_PARAM if key != JSON_OBJECT_KEY else "response_format"
        timeout = self.limits.compile_timeout_s
        try:
            result = await self.service.compile(key, timeout)
        except CompileRejected as exc:
            raise self._remember(digest, APIError(400, f"Invalid JSON schema: {exc}", param=param)) from None
        except CompileTimeout:
            raise self._remember(digest, APIError(
                400, f"The JSON schema did not compile within {timeout:g}s (--grammar-compile-timeout); "
                     "simplify it (fewer enum values, optional properties or long patterns).",
                param=param, code="schema_too_complex")) from None
        except CompileTooLarge as exc:
            raise self._remember(digest, APIError(
                400, f"The JSON schema is too complex: {exc}; simplify it.", param=param,
                code="schema_too_complex")) from None
        except CompilerBusy:
            raise APIError(503, f"Every grammar compiler stayed busy for {timeout:g}s; retry later.",
                           code="grammar_compiler_busy",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        except CompilerUnavailable as exc:
            raise APIError(503, f"Structured output is unavailable: {exc}",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        grammar = Grammar(digest, key, result.serialized, result.memory_bytes)
        if not self.cache.put(digest, grammar, grammar.nbytes):
            logger.warning("a compiled grammar of %d bytes is over the cache size (%d bytes): not cached",
                           grammar.nbytes, self.cache.capacity_bytes)
        logger.info("compiled a grammar in %.3fs (%d bytes; cache %d grammars, %d bytes)", result.seconds,
                    grammar.nbytes, len(self.cache), self.cache.bytes)
        return grammar

    def _remember(self, digest: str, error: APIError) -> APIError:
        self.stats.failures += 1
        self._failures[digest] = _Failure(time.monotonic(), error)
        self._failures.move_to_end(digest)
        while len(self._failures) > _MAX_FAILURES:
            self._failures.popitem(last=False)
        return error

    def _raise_known_failure(self, digest: str) -> None:
        failure = self._failures.get(digest)
        if failure is None:
            return
        if time.monotonic() - failure.at > _FAILURE_TTL_S:
            del self._failures[digest]
            return
        e = failure.error
        raise APIError(e.status, e.message, type=e.type, param=e.param, code=e.code)

    # ---- processors -----------------------------------------------------------------------
    def load(self, grammar: Grammar) -> Any:
        """Load `grammar` in this process (blocking; bounded by the worker's compile time): needed when the
        engine loop runs here; an engine process does it on its side."""
        if grammar.compiled is None:
            grammar.compiled = self._grammar_loader().load(grammar.key, grammar.serialized)
            self.stats.loads += 1
        return grammar.compiled

    def processor(self, grammar: Grammar) -> GrammarLogitsProcessor:
        info = self.info()
        return GrammarLogitsProcessor(grammar, info.vocab_size, list(info.stop_token_ids))

    async def aclose(self) -> None:
        await self.service.aclose()


def _log_prestart(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("the grammar compiler did not start: %s", task.exception())


def schema_text(fmt: ResponseFormat) -> bytes:
    """What a grammar is compiled from and cached by: the schema as compact JSON with its property
    order kept (the model writes properties in that order), or JSON_OBJECT_KEY for json_object."""
    if fmt.type != "json_schema":
        return JSON_OBJECT_KEY.encode()
    if fmt.json_schema is None:
        raise APIError(400, "response_format.json_schema is required when type is 'json_schema'",
                       param="response_format.json_schema")
    schema = fmt.json_schema.schema_
    try:
        return orjson.dumps(schema)
    except TypeError:  # orjson refuses integers past 64 bits and nesting past 255 levels
        pass
    try:
        return json.dumps(schema, ensure_ascii=False, separators=(",", ":")).encode()
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"Invalid JSON schema: {exc}", param=SCHEMA_PARAM) from exc


def wants_grammar(fmt: ResponseFormat | None) -> bool:
    return fmt is not None and fmt.type in ("json_object", "json_schema")


# ---------------------------------------------------------------------------------- engine process


class ProcessGrammars:
    """In an engine process: grammars that arrive in pickled processors, loaded once per key.

    Loading (compiling a fast grammar again, or deserializing a slow one) runs in a thread of its own,
    never in the engine's step loop: a processor comes back at once, and `ready()` tells when its grammar
    is there (xgrammar releases the GIL while it works)."""

    def __init__(self, loader: GrammarLoader, cache: ByteLRU[Grammar]) -> None:
        self.loader = loader
        self.cache = cache
        self.failures = 0
        self._lock = threading.Lock()
        self._loading: dict[str, Grammar] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-load")

    def processor(self, digest: str, key: str, serialized: str | None) -> GrammarLogitsProcessor:
        with self._lock:
            grammar = self.cache.get(digest) or self._loading.get(digest)
            if grammar is None:
                grammar = self._loading[digest] = Grammar(digest, "", None, 0)
                self._pool.submit(self._load, grammar, key, serialized)
        info = self.loader.info
        return GrammarLogitsProcessor(grammar, info.vocab_size, list(info.stop_token_ids))

    def _load(self, grammar: Grammar, key: str, serialized: str | None) -> None:
        try:
            compiled = self.loader.load(key, serialized)
            grammar.memory_bytes = int(compiled.memory_size_bytes)
            grammar.compiled = compiled
        except Exception as exc:  # noqa: BLE001 - reported through the request
            logger.exception("could not rebuild a grammar in the engine process")
            grammar.error = f"structured output: could not rebuild the grammar in the engine process ({exc})"
            self.failures += 1
        with self._lock:
            self._loading.pop(grammar.digest, None)
            if grammar.compiled is not None:
                self.cache.put(grammar.digest, grammar, grammar.nbytes)


_process_grammars: ProcessGrammars | None = None


def set_process_tokenizer(tokenizer: Any, cache_bytes: int = StructuredLimits.cache_bytes) -> None:
    """In an engine process: the tokenizer that processors arriving by pickle are rebuilt for."""
    global _process_grammars
    _process_grammars = ProcessGrammars(GrammarLoader(tokenizer_info(tokenizer)), ByteLRU(cache_bytes))


def process_grammars() -> ProcessGrammars | None:
    return _process_grammars


def _rebuild_processor(digest: str, key: str,
                       serialized: str | None) -> GrammarLogitsProcessor | FailedProcessor:
    # Runs inside pickle.loads in the engine process: it must not raise (that would fail the whole
    # command), so a grammar that cannot be rebuilt fails its own request when the engine calls it.
    try:
        if _process_grammars is None:
            raise RuntimeError("set_process_tokenizer() was not called in this process")
        return _process_grammars.processor(digest, key, serialized)
    except Exception as exc:  # noqa: BLE001 - reported through the request
        logger.exception("could not rebuild a grammar processor")
        message = f"structured output: could not rebuild the grammar in the engine process ({exc})"
        if _process_grammars is not None:
            _process_grammars.failures += 1
        return FailedProcessor(message)
