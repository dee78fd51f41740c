"""Budgets for structured output: what a `response_format` schema may cost the server.

The size limits answer 400 at once for the shapes whose compile time grows fastest, all
measured with xgrammar 0.2.9 on the default model's tokenizer (49k tokens), one core:

* `enum` values: 3,000 compile in 23 ms, 10,000 in 0.4 s (30 MB compiled), 20,000 in
  1.1 s (62 MB), 100,000 in minutes (GBs);
* object properties that are not required: 256 in 0.2 s, 512 in 0.44 s, 1,000 in 2.6 s,
  3,000 in 122 s (required ones cost far less: 3,000 in 0.6 s);
* the canonical schema text (compact JSON, order kept): 64 KiB holds any real tool schema.

No size limit bounds everything (`{"pattern": "^[a-z]{1,20000}$"}` is 30 bytes and takes
20 s), so every compile also runs under a timeout in a process that is killed when it
passes (see `grammar_worker.py`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from hasten.server.errors import APIError

SCHEMA_PARAM = "response_format.json_schema.schema"


def _default_compiles() -> int:
    return max(2, min(4, os.cpu_count() or 2))


@dataclass(frozen=True)
class StructuredLimits:
    max_schema_bytes: int = 64 * 1024  # of the schema as compact JSON text
    max_enum_values: int = 4096  # `enum` entries, summed over the whole schema
    max_properties: int = 512  # `properties` entries, summed over the whole schema
    compile_timeout_s: float = 10.0  # per compile; also the longest wait for a free compile slot
    cache_bytes: int = 256 * 1024 * 1024  # compiled grammars kept by the server (and by the engine process)
    max_compiles: int = _default_compiles()  # compiles running at once, each in its own process
    worker_recycle_bytes: int = 256 * 1024 * 1024  # a compile process that grew more than this exits
    # How a compiled grammar reaches the engine's process (grammar_worker.py), by the compile's CPU time:
    # within serialize_above_s it is compiled again there; slower, it goes serialized if that is smaller
    # than max_serialized_bytes and quicker to write than the compile was, else it is compiled again if
    # that takes at most max_recompile_s, else 400.
    serialize_above_s: float = 0.25
    max_serialized_bytes: int = 16 * 1024 * 1024
    max_recompile_s: float = 1.0
    prestart: bool = False  # start the compiler process with the server, not at the first schema

    def __post_init__(self) -> None:
        if min(self.max_schema_bytes, self.max_enum_values, self.max_properties, self.cache_bytes,
               self.max_compiles, self.worker_recycle_bytes) < 1:
            raise ValueError("structured-output limits must be positive")
        if not self.compile_timeout_s > 0 or self.max_serialized_bytes < 1:
            raise ValueError("compile_timeout_s and max_serialized_bytes must be positive")
        if self.serialize_above_s < 0 or self.max_recompile_s < 0:
            raise ValueError("serialize_above_s and max_recompile_s must be >= 0")


_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})  # values, not subschemas: not walked
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _count(schema: Any) -> tuple[int, int]:
    """(enum values, properties) in a parsed schema, walked without recursion (nesting depth is
    the client's choice). Every dict on the stack is a (sub)schema; name -> schema maps such as
    `properties` are opened, so a property called "enum" or "default" is still walked."""
    enums = props = 0
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
            continue
        if not isinstance(node, dict):
            continue
        enum = node.get("enum")
        if isinstance(enum, list):
            enums += len(enum)
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                if key == "properties":
                    props += len(value)
                stack.extend(v for v in value.values() if isinstance(v, (dict, list)))
            elif key not in _DATA_KEYWORDS and isinstance(value, (dict, list)):
                stack.append(value)
    return enums, props


def check_size(nbytes: int, limits: StructuredLimits) -> None:
    """400 if the schema's canonical JSON text is over --max-schema-bytes."""
    if nbytes > limits.max_schema_bytes:
        raise APIError(400, f"The JSON schema is {nbytes} bytes; this server accepts at most "
                            f"{limits.max_schema_bytes} (--max-schema-bytes).", param=SCHEMA_PARAM,
                       code="schema_too_large")


def check_counts(schema: Any, limits: StructuredLimits) -> None:
    """400 if the schema has more enum values or properties than this server compiles."""
    enums, props = _count(schema)
    if enums > limits.max_enum_values:
        raise APIError(400, f"The JSON schema has {enums} enum values; this server accepts at most "
                            f"{limits.max_enum_values} (--max-schema-enum-values).", param=SCHEMA_PARAM,
                       code="schema_too_large")
    if props > limits.max_properties:
        raise APIError(400, f"The JSON schema has {props} properties; this server accepts at most "
                            f"{limits.max_properties} (--max-schema-properties).", param=SCHEMA_PARAM,
                       code="schema_too_large")
