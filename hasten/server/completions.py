"""POST /v1/completions."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from hasten.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from hasten.server.generation import Plan, SubRequest, check_context, make_params
from hasten.server.limits import encode_large, offload
from hasten.server.protocol import CompletionRequest
from hasten.server.serving import Serving, Streamer, TokenText


def _prompts(serving: Serving, req: CompletionRequest, max_tokens: int,
             large: bool) -> tuple[list[list[int]], list[str | None]]:
    p = req.prompt
    texts: list[str | None]
    if isinstance(p, str):
        texts = [p]
    elif isinstance(p[0], str):
        texts = list(p)  # type: ignore[arg-type]
    elif isinstance(p[0], int):
        serving.check_token_ids(p, "prompt")  # type: ignore[arg-type]
        return [list(p)], [None]  # type: ignore[arg-type]
    else:
        for ids in p:
            serving.check_token_ids(ids, "prompt")  # type: ignore[arg-type]
        return [list(ids) for ids in p], [None] * len(p)  # type: ignore[union-attr]
    tokenizer, special = serving.tokenizer, req.add_special_tokens
    if large:  # (in a worker thread) a prompt that cannot fit is refused before its ids become a list

        def fits(count: int) -> None:
            check_context(count, max_tokens, serving.max_model_len, "prompt")

        return [encode_large(tokenizer, t, special, fits) for t in texts], texts  # type: ignore[arg-type]
    return [tokenizer.encode(t, add_special_tokens=special) for t in texts], texts  # type: ignore[misc]


def _logprobs(tt: TokenText, ids: list[int], entries: list[TokenLogprobs | None], k: int,
              offset: int) -> dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(ids, entries, strict=False):
        text = tt(tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(entry.get(tid))
        tops.append({tt(i): lp for i, lp in tt.top(entry, k)})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _merge_lp(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    if a is None:
        return b
    return {key: a[key] + b[key] for key in a}


async def create_completion(serving: Serving, request: Request, req: CompletionRequest,
                            request_id: str, large: bool = False) -> Response:
    """`large`: the body was large, so tokenize (or check the token ids) in a worker thread."""
    serving.check_model(req.model)
    max_tokens = req.max_tokens if req.max_tokens is not None else 16
    prompts, texts = await offload(large, _prompts, serving, req, max_tokens, large)
    for ids in prompts:
        check_context(len(ids), max_tokens, serving.max_model_len, "prompt")
    k = req.logprobs
    params = make_params(req, max_tokens=max_tokens, logprobs=k,
                         prompt_logprobs=k if (req.echo and k is not None) else None)
    created = int(time.time())
    model = serving.model_name
    tt = serving.token_text

    def echo_text(sub: SubRequest) -> str:
        text = texts[sub.prompt_index]
        return text if text is not None else serving.tokenizer.decode(sub.prompt_ids)

    def choice(sub: SubRequest, out: RequestOutput, comp: CompletionOutput) -> dict[str, Any]:
        text = comp.text
        lp = None
        if k is not None:
            lp = _logprobs(tt, comp.token_ids, list(comp.logprobs or []), k, 0)
        if req.echo:
            prefix = echo_text(sub)
            if k is not None:
                plp = list(out.prompt_logprobs or [None] * len(sub.prompt_ids))
                lp = _merge_lp(_logprobs(tt, sub.prompt_ids, plp, k, 0),
                               _logprobs(tt, comp.token_ids, list(comp.logprobs or []), k, len(prefix)))
            text = prefix + text
        return {"index": sub.choice_base + comp.index, "text": text, "logprobs": lp,
                "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason}

    def build(finals: list[RequestOutput], plan: Plan) -> dict[str, Any]:
        choices = [choice(sub, out, comp) for sub, out in zip(plan.subs, finals, strict=True)
                   for comp in out.outputs]
        choices.sort(key=lambda c: c["index"])
        return {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": serving.usage(finals, plan)}

    def streamer(plan: Plan) -> Streamer:
        head = {"id": request_id, "object": "text_completion", "created": created, "model": model}
        sent_finish: set[int] = set()
        opening = []
        if req.echo:
            for sub in plan.subs:
                for i in range(sub.params.n):
                    opening.append({**head, "choices": [{"index": sub.choice_base + i, "text": echo_text(sub),
                                                         "logprobs": None, "finish_reason": None}]})

        def chunks(sub: SubRequest, out: RequestOutput) -> list[dict[str, Any]]:
            result = []
            for comp in out.outputs:
                index = sub.choice_base + comp.index
                finishing = comp.finish_reason is not None and index not in sent_finish
                if not comp.delta_token_ids and not comp.delta_text and not finishing:
                    continue
                lp = None
                if k is not None:
                    lp = _logprobs(tt, comp.delta_token_ids, list(comp.delta_logprobs or []), k, 0)
                if finishing:
                    sent_finish.add(index)
                result.append({**head, "choices": [{
                    "index": index, "text": comp.delta_text, "logprobs": lp,
                    "finish_reason": comp.finish_reason if finishing else None,
                    **({"stop_reason": comp.stop_reason} if finishing else {})}]})
            return result

        return Streamer(opening, chunks, lambda usage: {**head, "choices": [], "usage": usage})

    return await serving.run(request, request_id, prompts, params, req, build, streamer)
