"""POST /v1/responses: the Responses API, stateless, on top of the chat path.

A request becomes a chat request (`instructions` -> a system message, `input` items -> messages, function
calls and their outputs -> assistant `tool_calls` and `tool` messages, `text.format` -> `response_format`,
`max_output_tokens` -> `max_tokens`) and runs exactly like /v1/chat/completions, tools included (tools.py).
Nothing is stored: `previous_response_id` is a 400. Streams are the Responses API's events (each a `data:`
line carrying its `type` and `sequence_number`), ending with `response.completed` (or `response.incomplete`
when `max_output_tokens` cut the answer short).
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from hasten.outputs import CompletionOutput, RequestOutput
from hasten.server.chat import final_answer, prepare_chat
from hasten.server.errors import APIError
from hasten.server.generation import Plan, SubRequest
from hasten.server.protocol import (
    ChatCompletionRequest,
    ResponseFunctionCallItem,
    ResponseFunctionOutputItem,
    ResponsesRequest,
)
from hasten.server.serving import Serving, Streamer
from hasten.server.tool_parsers import ToolCall, ToolStream

# Where a chat-side 400 points, in Responses terms.
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
           "response_format.json_schema": "text.format", "response_format.json_schema.schema": "text.format.schema"}


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    if req.previous_response_id is not None:
        raise APIError(400, "previous_response_id is not supported: this server stores no responses. Send the "
                            "whole conversation in `input`.", param="previous_response_id")
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = [] if isinstance(req.input, str) else req.input
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    for item in items:
        if isinstance(item, ResponseFunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, ResponseFunctionOutputItem):
            messages.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
        else:
            messages.append({"role": item.role, "content": item.text()})
    body: dict[str, Any] = {"model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
                            "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
                            "parallel_tool_calls": req.parallel_tool_calls, "user": req.user}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if isinstance(req.tool_choice, str):
        body["tool_choice"] = req.tool_choice
    elif req.tool_choice is not None:
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
    return ChatCompletionRequest.model_validate(body)


def _echo(req: ResponsesRequest, request_id: str, created: int, model: str) -> dict[str, Any]:
    """The request's settings as a Response object carries them."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    text_format: dict[str, Any] = {"type": "text"}
    if fmt is not None and fmt.type != "text":
        text_format = {"type": fmt.type}
        if fmt.type == "json_schema":
            text_format.update(name=fmt.name, schema=fmt.schema_, strict=bool(fmt.strict))
    tool_choice: Any = req.tool_choice or "auto"
    if not isinstance(tool_choice, str):
        tool_choice = tool_choice.model_dump()
    return {"id": request_id, "object": "response", "created_at": created, "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": model, "output": [],
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None,
            "temperature": req.temperature, "top_p": req.top_p, "tool_choice": tool_choice,
            "tools": [{**t.model_dump(exclude_none=True), "parameters": t.parameters or {},
                       "strict": bool(t.strict)} for t in req.tools or []],
            "text": {"format": text_format}, "truncation": "disabled", "metadata": req.metadata or {},
            "store": False, "usage": None}


def _message(msg_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": msg_id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call: ToolCall, status: str, arguments: str | None = None) -> dict[str, Any]:
    return {"id": "fc_" + call.id.removeprefix("call_"), "type": "function_call", "status": status,
            "call_id": call.id, "name": call.name, "arguments": call.arguments if arguments is None else arguments}


def _usage(prompt_tokens: int, comp: CompletionOutput, out: RequestOutput) -> dict[str, Any]:
    generated = len(comp.token_ids)
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
            "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + generated}


def _finished(base: dict[str, Any], finish: str | None, output: list[dict[str, Any]],
              usage: dict[str, Any]) -> dict[str, Any]:
    cut = finish == "length"
    return {**base, "status": "incomplete" if cut else "completed", "output": output, "usage": usage,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None}


async def create_response(serving: Serving, request: Request, req: ResponsesRequest, request_id: str,
                          large: bool = False, parser_flag: str | None = None) -> Response:
    try:
        return await _create(serving, request, req, request_id, large, parser_flag)
    except APIError as exc:
        exc.param = _PARAMS.get(exc.param or "", exc.param)
        raise


async def _create(serving: Serving, request: Request, req: ResponsesRequest, request_id: str, large: bool,
                  parser_flag: str | None) -> Response:
    setup = await prepare_chat(serving, request, to_chat_request(req), large, parser_flag)
    tools = setup.tools
    base = _echo(req, request_id, int(time.time()), serving.model_name)
    prompt_tokens = len(setup.ids)
    msg_id = "msg_" + secrets.token_hex(12)

    def build(finals: list[RequestOutput], plan: Plan) -> dict[str, Any]:
        out = finals[0]
        comp = out.outputs[0]
        content, calls, finish = final_answer(tools, comp)
        status = "incomplete" if finish == "length" else "completed"
        output = [_message(msg_id, content or "", status)] if content or not calls else []
        output += [_call_item(c, "completed") for c in calls]
        return _finished(base, finish, output, _usage(prompt_tokens, comp, out))

    def streamer(plan: Plan) -> Streamer:
        seq = iter(range(1 << 62))
        state: dict[str, Any] = {"text": "", "open": False}
        stream = ToolStream(tools.parser, tools.names) if tools is not None else None

        def event(kind: str, **fields: Any) -> dict[str, Any]:
            return {"type": kind, "sequence_number": next(seq), **fields}

        def text_events(delta: str) -> list[dict[str, Any]]:
            events = []
            if not state["open"]:
                state["open"] = True
                events.append(event("response.output_item.added", output_index=0,
                                    item={**_message(msg_id, "", "in_progress"), "content": []}))
                events.append(event("response.content_part.added", item_id=msg_id, output_index=0,
                                    content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
            if delta:
                state["text"] += delta
                events.append(event("response.output_text.delta", item_id=msg_id, output_index=0,
                                    content_index=0, delta=delta, logprobs=[]))
            return events

        def chunks(sub: SubRequest, out: RequestOutput) -> list[dict[str, Any]]:
            comp = out.outputs[0]
            delta = stream.feed(comp.delta_text) if stream is not None else comp.delta_text
            events = text_events(delta) if delta else []
            if comp.finish_reason is None:
                return events
            rest, calls = stream.finish() if stream is not None else ("", [])
            if rest or not (calls or state["open"]):
                events += text_events(rest)
            finish = "tool_calls" if calls else comp.finish_reason
            status = "incomplete" if finish == "length" else "completed"
            output = []
            if state["open"]:
                text = state["text"]
                part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                events.append(event("response.output_text.done", item_id=msg_id, output_index=0,
                                    content_index=0, text=text, logprobs=[]))
                events.append(event("response.content_part.done", item_id=msg_id, output_index=0,
                                    content_index=0, part=part))
                output.append(_message(msg_id, text, status))
                events.append(event("response.output_item.done", output_index=0, item=output[-1]))
            for call in calls:
                index = len(output)
                item = _call_item(call, "completed")
                events.append(event("response.output_item.added", output_index=index,
                                    item=_call_item(call, "in_progress", "")))
                events.append(event("response.function_call_arguments.delta", item_id=item["id"],
                                    output_index=index, delta=call.arguments))
                events.append(event("response.function_call_arguments.done", item_id=item["id"],
                                    output_index=index, name=call.name, arguments=call.arguments))
                events.append(event("response.output_item.done", output_index=index, item=item))
                output.append(item)
            final = _finished(base, finish, output, _usage(prompt_tokens, comp, out))
            events.append(event("response.completed" if status == "completed" else "response.incomplete",
                                response=final))
            return events

        opening = [event("response.created", response=base), event("response.in_progress", response=base)]
        # The usage travels in response.completed; the chat request built here asks for no usage chunk.
        return Streamer(opening, chunks, lambda usage: {})

    return await serving.run(request, request_id, [setup.ids], setup.params, setup.run_req, build, streamer)
