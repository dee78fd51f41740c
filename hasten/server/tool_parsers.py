"""Recognising a model's own tool-call syntax in its output (`tool_choice: "auto"`).

Two formats:

* `hermes` (Hermes, Qwen 2/2.5/3 and other ChatML models): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them, after optional text;
* `llama3_json` (Llama 3.1-3.3): the whole answer is `{"name": ..., "parameters": {...}}` (several separated by
  `;`), optionally after `<|python_tag|>`.

A call is recognised only when its JSON parses (the stdlib decoder), is an object with a string `name` that is one
of the request's tools, and its arguments are an object; otherwise the whole text stays content. `ToolStream`
does the same on a stream: text that cannot be part of a call is passed on as it comes, a call is held back
until the output ends.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes", "llama3_json")
_HERMES_OPEN = "<tool_call>"
_HERMES_CLOSE = "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_decoder = json.JSONDecoder()


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def as_message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parser_for_template(template: str | None) -> str | None:
    """The format a chat template teaches its model, if it has one."""
    if not template:
        return None
    if _HERMES_OPEN in template:
        return "hermes"
    if _PYTHON_TAG in template or ("ipython" in template and "parameters" in template):
        return "llama3_json"
    return None


def call_from_json(obj: Any, names: set[str]) -> ToolCall | None:
    """`{"name": ..., "arguments"|"parameters": {...}}` -> a ToolCall, if it names one of `names`."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str, separators: str) -> list[Any] | None:
    """Every JSON value in `text`, separated by whitespace or `separators`; None if anything else is there."""
    values, pos = [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = _decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)


def _parse_hermes(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return text, []
    calls, pos = [], start
    while pos < len(text):
        if text.startswith(_HERMES_OPEN, pos):
            end = text.find(_HERMES_CLOSE, pos)
            body = text[pos + len(_HERMES_OPEN): end if end >= 0 else len(text)]
            values = _json_values(body, "")
            if values is None or len(values) != 1 or (call := call_from_json(values[0], names)) is None:
                return text, []
            calls.append(call)
            pos = len(text) if end < 0 else end + len(_HERMES_CLOSE)
        elif text[pos].isspace():
            pos += 1
        else:  # text after a call: not a well-formed answer
            return text, []
    content = text[:start].strip()
    return content or None, calls


def _parse_llama3(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):]
    if not body.lstrip().startswith("{"):
        return text, []
    values = _json_values(body, ";")
    calls = [call_from_json(v, names) for v in values or []]
    if not calls or any(c is None for c in calls):
        return text, []
    return None, [c for c in calls if c is not None]


def parse_tool_calls(parser: str, text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer; no calls -> the text unchanged."""
    if parser == "hermes":
        return _parse_hermes(text, names)
    return _parse_llama3(text, names)


def parse_forced(text: str, names: set[str]) -> list[ToolCall]:
    """The output of a grammar-constrained call (`required` / a named function): one call object or an array."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = [call_from_json(v, names) for v in items]
    return [] if any(c is None for c in calls) else [c for c in calls if c is not None]


class ToolStream:
    """One choice's streamed text: what may be sent as content now, and the calls once it ends.

    `parser=None` (a grammar-constrained call): everything is held back until the end."""

    def __init__(self, parser: str | None, names: set[str]) -> None:
        self.parser = parser
        self.names = names
        self.text = ""
        self.sent = 0  # characters of `text` passed on as content
        self.holding = parser is None  # a call has started: hold everything back
        self.free = False  # llama3_json: the answer did not start with a call, so it is content

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.holding:
            return ""
        end = self._safe_end()
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out

    def _safe_end(self) -> int:
        text = self.text
        if self.parser == "hermes":
            start = text.find(_HERMES_OPEN, max(0, self.sent - len(_HERMES_OPEN)))
            if start >= 0:
                self.holding = True
                return start
            for keep in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1):  # a tag may be arriving
                if _HERMES_OPEN.startswith(text[-keep:]):
                    return len(text) - keep
            return len(text)
        if self.free:
            return len(text)
        head = text.lstrip()
        if not head or _PYTHON_TAG.startswith(head):
            return self.sent
        if head.startswith("{") or head.startswith(_PYTHON_TAG):
            self.holding = True
            return self.sent
        self.free = True
        return len(text)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, calls) once the output has ended."""
        if self.parser is None:
            calls = parse_forced(self.text, self.names)
            return ("" if calls else self.text), calls
        _, calls = parse_tool_calls(self.parser, self.text, self.names)
        if calls:
            return "", calls
        rest = self.text[self.sent:]
        self.sent = len(self.text)
        return rest, []
