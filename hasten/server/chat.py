"""POST /v1/chat/completions."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from hasten.outputs import RequestOutput, TokenLogprobs
from hasten.server.errors import APIError
from hasten.server.generation import Plan, SubRequest, check_context, make_params
from hasten.server.limits import encode_large, offload
from hasten.server.protocol import ChatCompletionRequest, ChatMessage
from hasten.server.serving import Serving, Streamer, TokenText


def chat_prompt(serving: Serving, messages: list[ChatMessage], add_generation_prompt: bool,
                large: bool = False) -> list[int]:
    """The prompt ids of a conversation. `large` (called in a worker thread for a large body): the
    template is rendered to text and tokenized by `encode_large`, so that a conversation that cannot fit
    the context is refused before its ids become a Python list (which holds the GIL)."""
    plain = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in messages]
    try:
        if large:
            text = serving.tokenizer.apply_chat_template(plain, tokenize=False,
                                                         add_generation_prompt=add_generation_prompt)
        else:
            return list(serving.engine.apply_chat_template(plain, add_generation_prompt=add_generation_prompt))
    except Exception as exc:  # jinja errors: e.g. a template that rejects this role order
        raise APIError(400, f"Could not apply the chat template: {exc}", param="messages") from exc

    def fits(count: int) -> None:
        check_context(count, 1, serving.max_model_len, "messages")

    return encode_large(serving.tokenizer, text, False, fits)


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
                                 request_id: str, large: bool = False) -> Response:
    """`large`: the body was large, so apply the chat template and tokenize in a worker thread."""
    serving.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    ids = await offload(large, chat_prompt, serving, req.messages, req.add_generation_prompt, large)
    max_tokens = req.max_completion_tokens or req.max_tokens
    if max_tokens is None:
        max_tokens = max(1, serving.max_model_len - len(ids))
    check_context(len(ids), max_tokens, serving.max_model_len, "messages")
    k = (req.top_logprobs or 0) if req.logprobs else None
    params = make_params(req, max_tokens=max_tokens, logprobs=k)
    created = int(time.time())
    model = serving.model_name
    tt = serving.token_text

    def build(finals: list[RequestOutput], plan: Plan) -> dict[str, Any]:
        choices = []
        for sub, out in zip(plan.subs, finals, strict=True):
            for comp in out.outputs:
                lp = _logprobs(tt, comp.token_ids, list(comp.logprobs or []), k) if k is not None else None
                choices.append({"index": sub.choice_base + comp.index,
                                "message": {"role": "assistant", "content": comp.text},
                                "logprobs": lp, "finish_reason": comp.finish_reason,
                                "stop_reason": comp.stop_reason})
        choices.sort(key=lambda c: c["index"])
        return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": serving.usage(finals, plan)}

    def streamer(plan: Plan) -> Streamer:
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        sent_finish: set[int] = set()
        opening = [{**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]}
                   for i in range(plan.num_choices)]

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
                delta = {"content": comp.delta_text} if (comp.delta_text or not finishing) else {}
                if finishing:
                    sent_finish.add(index)
                result.append({**head, "choices": [{
                    "index": index, "delta": delta, "logprobs": lp,
                    "finish_reason": comp.finish_reason if finishing else None,
                    **({"stop_reason": comp.stop_reason} if finishing else {})}]})
            return result

        return Streamer(opening, chunks, lambda usage: {**head, "choices": [], "usage": usage})

    return await serving.run(request, request_id, [ids], params, req, build, streamer)
