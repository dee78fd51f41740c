"""Tool calling: how a request's tools reach the prompt, and how calls come out of the output.

* `tool_choice: "none"` (or no tools): the tools are left out of the prompt; the answer is text.
* `"required"` or a named function: the output is generated under a grammar built from the functions' JSON
  schemas (compiled and enforced like `response_format`, see structured.py): one object
  `{"name": <const>, "arguments": <the function's parameters schema>}` — for `required` an `anyOf` over the
  tools, and with `parallel_tool_calls` (the default) an array of 1 to MAX_PARALLEL_CALLS of those — so the
  calls always parse and their arguments validate (unless `max_tokens` cuts them short).
* `"auto"` (the default with tools): the model answers freely and its own tool-call syntax is recognised by a
  parser (tool_parsers.py): the one named by `--tool-call-parser`, else the one its chat template uses.

The prompt: a chat template that takes `tools` (it mentions them) gets them, and the history's assistant
`tool_calls` and `tool` messages, natively. A template with no tool syntax (SmolLM2's) gets the tools described
in the system message, with the Hermes format as the way to call them; assistant calls in the history are
written in that format and tool results become user messages wrapped in `<tool_response>`; `auto` then uses
the `hermes` parser.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hasten.server.errors import APIError
from hasten.server.protocol import ChatMessage, ChatTool, ResponseFormat
from hasten.server.tool_parsers import parser_for_template

MAX_PARALLEL_CALLS = 8  # calls in one constrained answer (a sampled small model can otherwise loop on them)
_SYSTEM_TOOLS = (
    "You may call one or more functions to help with the user's request. The functions are described, as "
    "JSON schemas, within <tools></tools>:\n<tools>\n{tools}\n</tools>\n\nTo call a function, answer with a "
    "JSON object holding its name and arguments within <tool_call></tool_call> tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass
class ToolPlan:
    """How one request uses its tools."""

    tools: list[ChatTool]
    choice: str  # "none" | "auto" | "forced"
    parser: str | None  # auto: the format recognised in the output
    grammar: ResponseFormat | None  # forced: the JSON schema the output is generated under

    @property
    def names(self) -> set[str]:
        return {t.function.name for t in self.tools}


def template_takes_tools(template: str | None) -> bool:
    return bool(template) and "tools" in str(template)


def plan_tools(tools: list[ChatTool] | None, tool_choice: Any, parallel: bool, template: str | None,
               parser_flag: str | None, param: str = "tool_choice") -> ToolPlan | None:
    """None when the request has no tools (or `tool_choice` is "none")."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs `tools`.", param=param)
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "Tool names must be unique.", param="tools")
    if tool_choice == "none":
        return None
    if tool_choice in (None, "auto"):
        native = template_takes_tools(template)
        parser = parser_flag or (parser_for_template(template) if native else "hermes") or "hermes"
        return ToolPlan(tools, "auto", parser, None)
    if tool_choice == "required":
        chosen = tools
    else:
        name = tool_choice.function.name
        chosen = [t for t in tools if t.function.name == name]
        if not chosen:
            raise APIError(400, f"tool_choice names `{name}`, which is not among the tools.", param=param)
        parallel = False
    schemas = [call_schema(t) for t in chosen]
    schema: dict[str, Any] = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if parallel:
        schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}
    fmt = ResponseFormat.model_validate({"type": "json_schema",
                                         "json_schema": {"name": "tool_calls", "schema": schema}})
    return ToolPlan(tools, "forced", None, fmt)


def call_schema(tool: ChatTool) -> dict[str, Any]:
    params = tool.function.parameters or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": params},
            "required": ["name", "arguments"]}


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _tool_json(tool: ChatTool) -> dict[str, Any]:
    return {"type": "function", "function": tool.function.model_dump(exclude_none=True)}


def render_messages(messages: list[ChatMessage], plan: ToolPlan | None, template: str | None
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages for the chat template, `tools=` for it)."""
    native = template_takes_tools(template)
    out: list[dict[str, Any]] = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            if native:
                msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
            else:
                calls = "\n".join("<tool_call>\n" + json.dumps(
                    {"name": c.function.name, "arguments": _arguments(c.function.arguments)}, ensure_ascii=False)
                    + "\n</tool_call>" for c in m.tool_calls)
                msg["content"] = (msg["content"] + "\n" + calls) if msg["content"] else calls
        if m.role == "tool":
            if native:
                if m.tool_call_id:
                    msg["tool_call_id"] = m.tool_call_id
            else:
                msg = {"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"}
        out.append(msg)
    if plan is None:
        return out, None
    if native:
        return out, [_tool_json(t) for t in plan.tools]
    described = _SYSTEM_TOOLS.format(tools="\n".join(json.dumps(_tool_json(t), ensure_ascii=False)
                                                     for t in plan.tools))
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" + described).strip()}
    else:
        out.insert(0, {"role": "system", "content": described})
    return out, None
