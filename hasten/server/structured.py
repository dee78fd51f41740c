"""Structured output (`response_format`) by constrained decoding with xgrammar.

`StructuredOutput.processor_for(response_format)` returns a logits processor that the
engine calls before sampling every token of one sequence:
`processor(output_token_ids, logits_row)`. It feeds the tokens generated since its
last call to an xgrammar `GrammarMatcher` and masks every token the grammar does not
allow at this point to -inf, in place. Once the JSON value is complete only the stop
token is allowed, so the output always parses and matches the schema (unless
`max_tokens` cuts it short, which the client sees as finish_reason="length").

Whitespace between JSON tokens is not allowed (`any_whitespace=False`): a small model
left free to emit whitespace can loop on it until max_tokens.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import Any

from hasten.server.errors import APIError
from hasten.server.protocol import ResponseFormat

logger = logging.getLogger("hasten.server.structured")

_CACHE_SIZE = 128
JSON_OBJECT_KEY = "<json_object>"


class GrammarLogitsProcessor:
    """Masks one sequence's logits to what its grammar allows next. Not shared between sequences."""

    def __init__(self, compiled_grammar: Any, vocab_size: int, stop_token_ids: list[int], key: str = "") -> None:
        import xgrammar as xg

        self._xg = xg
        self.key = key  # what the grammar was compiled from: enough to rebuild it in another process
        self._compiled = compiled_grammar
        self.matcher = xg.GrammarMatcher(compiled_grammar)
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.bitmask = xg.allocate_token_bitmask(1, vocab_size)
        self.num_accepted = 0
        self.rejected = False  # a token the grammar did not allow was forced in (engine bug)

    def __reduce__(self) -> tuple:
        # The xgrammar matcher cannot be pickled; a fresh processor is rebuilt from the grammar's key by
        # the receiving process (the engine process), which must have called `set_process_tokenizer`.
        if self.num_accepted:
            raise TypeError("a GrammarLogitsProcessor in use cannot be moved to another process")
        return (_rebuild_processor, (self.key,))

    def _catch_up(self, output_token_ids: list[int]) -> None:
        if len(output_token_ids) < self.num_accepted:
            # The sequence got shorter (e.g. recomputed after preemption): replay from scratch.
            self.matcher = self._xg.GrammarMatcher(self._compiled)
            self.num_accepted = 0
            self.rejected = False
        for token in output_token_ids[self.num_accepted:]:
            self.num_accepted += 1
            if self.rejected or self.matcher.is_terminated():
                continue
            if not self.matcher.accept_token(token):
                logger.warning("token %d was not allowed by the grammar", token)
                self.rejected = True

    def __call__(self, output_token_ids: list[int], logits: Any) -> None:
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
            self._xg.apply_token_bitmask_inplace(row, self.bitmask, vocab_size=n)
        else:
            mask = self.bitmask.to(row.device, non_blocking=True)
            self._xg.apply_token_bitmask_inplace(row, mask, vocab_size=n, backend="torch_native")
        if n < width:
            logits[n:] = float("-inf")  # padding rows of the model's vocab are never valid


class StructuredOutput:
    """Compiles and caches grammars for one tokenizer; hands out per-sequence processors."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._info: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()

    def _ensure_compiler(self) -> None:
        if self._compiler is not None:
            return
        import xgrammar as xg

        tok = self._tokenizer
        stop = [tok.eos_token_id] if tok.eos_token_id is not None else None
        self._info = xg.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=stop)
        self._compiler = xg.GrammarCompiler(self._info, max_threads=1)

    @staticmethod
    def key_for(fmt: ResponseFormat) -> str:
        if fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise APIError(400, "response_format.json_schema is required when type is 'json_schema'",
                               param="response_format.json_schema")
            return json.dumps(fmt.json_schema.schema_, sort_keys=True)
        return JSON_OBJECT_KEY

    def compile(self, fmt: ResponseFormat) -> Any:
        """Blocking (milliseconds to seconds for big schemas): call it from a worker thread."""
        return self.compile_key(self.key_for(fmt))

    def compile_key(self, key: str) -> Any:
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            self._ensure_compiler()
            try:
                if key == JSON_OBJECT_KEY:  # any JSON object (like OpenAI's JSON mode)
                    compiled = self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                                  strict_mode=False)
                else:
                    compiled = self._compiler.compile_json_schema(key, any_whitespace=False)
            except Exception as exc:  # xgrammar raises RuntimeError/ValueError for bad schemas
                raise APIError(400, f"Invalid JSON schema: {exc}",
                               param="response_format.json_schema.schema") from exc
            self._cache[key] = compiled
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            return compiled

    def processor(self, compiled: Any, key: str = "") -> GrammarLogitsProcessor:
        return GrammarLogitsProcessor(compiled, self._info.vocab_size, list(self._info.stop_token_ids), key)


_process_structured: StructuredOutput | None = None


def set_process_tokenizer(tokenizer: Any) -> None:
    """In an engine process: the tokenizer that processors arriving by pickle are rebuilt for."""
    global _process_structured
    _process_structured = StructuredOutput(tokenizer)


def _rebuild_processor(key: str) -> GrammarLogitsProcessor:
    if _process_structured is None:
        raise RuntimeError("set_process_tokenizer() was not called in this process")
    return _process_structured.processor(_process_structured.compile_key(key), key)


def wants_grammar(fmt: ResponseFormat | None) -> bool:
    return fmt is not None and fmt.type in ("json_object", "json_schema")
