"""POST /v1/chat/completions (tools: tools.py, tool_parsers.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from hasten.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from hasten.sampling_params import SamplingParams
from hasten.server.errors import APIError
from hasten.server.generation import Plan, SubRequest, check_context, make_params
from hasten.server.limits import encode_large, offload
from hasten.server.protocol import ChatCompletionRequest, ChatMessage
from hasten.server.serving import Serving, Streamer, TokenText
from hasten.server.tool_parsers import ToolCall, ToolStream, parse_forced, parse_tool_calls
from hasten.server.tools import ToolPlan, plan_tools, render_messages


def chat_prompt(serving: Serving, messages: list[ChatMessage], add_generation_prompt: bool,
                large: bool = False, tools: ToolPlan | None = None) -> list[int]:
    """The prompt ids of a conversation. `large` (called in a worker thread for a large body): the
    template is rendered to text and tokenized by `encode_large`, so that a conversation that cannot fit
    the context is refused before its ids become a Python list (which holds the GIL)."""
    template = getattr(serving.tokenizer, "chat_template", None)
    plain, tools_json = render_messages(messages, tools, template)
    try:
        if large or tools_json is not None:
            kwargs: dict[str, Any] = {"tools": tools_json} if tools_json is not None else {}
            text = serving.tokenizer.apply_chat_template(plain, tokenize=False,
                                                         add_generation_prompt=add_generation_prompt, **kwargs)
        else:
            return list(serving.engine.apply_chat_template(plain, add_generation_prompt=add_generation_prompt))
    except Exception as exc:  # jinja errors: e.g. a template that rejects this role order
        raise APIError(400, f"Could not apply the chat template: {exc}", param="messages") from exc

    def fits(count: int) -> None:
        check_context(count, 1, serving.max_model_len, "messages")

    if not large:
        return list(serving.tokenizer.encode(text, add_special_tokens=False))
    return encode_large(serving.tokenizer, text, False, fits)


@dataclass
class ChatSetup:
    """A chat request made ready to run: its prompt, sampling parameters and tool use."""

    ids: list[int]
    params: SamplingParams
    tools: ToolPlan | None
    run_req: ChatCompletionRequest  # the request as run (a forced tool call's grammar as its response_format)


async def prepare_chat(serving: Serving, request: Request, req: ChatCompletionRequest, large: bool,
                       parser_flag: str | None, logprobs: int | None = None) -> ChatSetup:
    serving.check_model(req.model)
    template = getattr(serving.tokenizer, "chat_template", None)
    tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, template, parser_flag)
    run_req = req
    if tools is not None and tools.grammar is not None:
        if req.response_format is not None and req.response_format.type != "text":
            raise APIError(400, "response_format cannot be combined with a required or named tool_choice.",
                           param="response_format")
        run_req = req.model_copy(update={"response_format": tools.grammar})
        try:  # compiled (or found in the cache) now, so that a bad tool schema is blamed on `tools`
            await serving.processor_factory(run_req, request)
        except APIError as exc:
            if exc.param and exc.param.startswith("response_format"):
                exc.param = "tools"
            raise
    ids = await offload(large, chat_prompt, serving, req.messages, req.add_generation_prompt, large, tools)
    max_tokens = req.max_completion_tokens or req.max_tokens
    if max_tokens is None:
        max_tokens = max(1, serving.max_model_len - len(ids))
    check_context(len(ids), max_tokens, serving.max_model_len, "messages")
    params = make_params(req, max_tokens=max_tokens, logprobs=logprobs)
    return ChatSetup(ids, params, tools, run_req)


def final_answer(tools: ToolPlan | None, comp: CompletionOutput) -> tuple[str | None, list[ToolCall], str | None]:
    """(content, tool calls, finish_reason) of a finished choice."""
    if tools is None:
        return comp.text, [], comp.finish_reason
    if tools.parser is None:
        calls = parse_forced(comp.text, tools.names)
        content = None if calls else comp.text
    else:
        content, calls = parse_tool_calls(tools.parser, comp.text, tools.names)
    return content, calls, ("tool_calls" if calls else comp.finish_reason)


def tool_call_deltas(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Stream deltas for finished calls, as OpenAI sends them: the call's head, then its arguments."""
    deltas = []
    for i, call in enumerate(calls):
        deltas.append({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                       "function": {"name": call.name, "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
    return deltas


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _logprobs(tt: TokenText, ids: list[int], entries: list[TokenLogprobs], k: int) -> dict[str, Any]:
    content = []
    for tid, entry in zip(ids, entries, strict=False):
        item = _entry(tt(tid), entry.get(tid, float("-inf")))
        item["top_logprobs"] = [_entry(tt(i), lp) for i, lp in tt.top(entry, k)]
        content.append(item)
    return {"content": content}


async def create_chat_completion(serving: Serving, request: Request, req: ChatCompletionRequest,
                                 request_id: str, large: bool = False, parser_flag: str | None = None) -> Response:
    """`large`: the body was large, so apply the chat template and tokenize in a worker thread.
    `parser_flag`: --tool-call-parser."""
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    k = (req.top_logprobs or 0) if req.logprobs else None
    setup = await prepare_chat(serving, request, req, large, parser_flag, logprobs=k)
    tools = setup.tools
    created = int(time.time())
    model = serving.model_name
    tt = serving.token_text

    def build(finals: list[RequestOutput], plan: Plan) -> dict[str, Any]:
        choices = []
        for sub, out in zip(plan.subs, finals, strict=True):
            for comp in out.outputs:
                lp = _logprobs(tt, comp.token_ids, list(comp.logprobs or []), k) if k is not None else None
                content, calls, finish = final_answer(tools, comp)
                message: dict[str, Any] = {"role": "assistant", "content": content}
                if calls:
                    message["tool_calls"] = [c.as_message() for c in calls]
                choices.append({"index": sub.choice_base + comp.index, "message": message,
                                "logprobs": lp, "finish_reason": finish, "stop_reason": comp.stop_reason})
        choices.sort(key=lambda c: c["index"])
        return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": serving.usage(finals, plan)}

    def streamer(plan: Plan) -> Streamer:
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        sent_finish: set[int] = set()
        streams: dict[int, ToolStream] = {}
        opening = [{**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]}
                   for i in range(plan.num_choices)]

        def chunk(index: int, delta: dict[str, Any], lp: Any = None) -> dict[str, Any]:
            return {**head, "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": None}]}

        def chunks(sub: SubRequest, out: RequestOutput) -> list[dict[str, Any]]:
            result = []
            for comp in out.outputs:
                index = sub.choice_base + comp.index
                finishing = comp.finish_reason is not None and index not in sent_finish
                if not comp.delta_token_ids and not comp.delta_text and not finishing:
                    continue
                lp = None
                if k is not None:
                    lp = _logprobs(tt, comp.delta_token_ids, list(comp.delta_logprobs or []), k)
                text, finish, calls = comp.delta_text, comp.finish_reason, []
                if tools is not None:
                    stream = streams.setdefault(index, ToolStream(tools.parser, tools.names))
                    text = stream.feed(comp.delta_text)
                    if finishing:
                        rest, calls = stream.finish()
                        text += rest
                        finish = "tool_calls" if calls else finish
                    elif not text and lp is None:
                        continue  # held back: the start of a tool call
                delta = {"content": text} if (text or not finishing) else {}
                if finishing:
                    sent_finish.add(index)
                    if calls:
                        if delta or lp:
                            result.append(chunk(index, delta, lp))
                        delta, lp = {}, None
                        result.extend(chunk(index, d) for d in tool_call_deltas(calls))
                result.append({**head, "choices": [{
                    "index": index, "delta": delta, "logprobs": lp,
                    "finish_reason": finish if finishing else None,
                    **({"stop_reason": comp.stop_reason} if finishing else {})}]})
            return result

        return Streamer(opening, chunks, lambda usage: {**head, "choices": [], "usage": usage})

    return await serving.run(request, request_id, [setup.ids], setup.params, setup.run_req, build, streamer)
