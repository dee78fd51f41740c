"""POST /v1/responses with the official SDK (`client.responses.create` / `client.responses.stream`) on the
default model: text, instructions, message lists, `text.format` json_schema, tools, function-call history,
and the 400s (stateless: `previous_response_id`)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from .default_model import default_server
from .harness import ServerThread

WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def smol(request: pytest.FixtureRequest) -> ServerThread:
    return default_server(request)


@pytest.fixture(scope="module")
def oai(smol: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=smol.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(oai: openai.OpenAI) -> str:
    return oai.models.list().data[0].id


def test_create_text(oai: openai.OpenAI, model: str) -> None:
    r = oai.responses.create(model=model, input="Name a colour.", instructions="Answer in one word.",
                             max_output_tokens=12, temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.output_text
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens > 5 and 0 < r.usage.output_tokens <= 12
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    cut = oai.responses.create(model=model, input="Tell me a long story.", max_output_tokens=3, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3
    messages = oai.responses.create(model=model, temperature=0, max_output_tokens=12, input=[
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]}])
    assert messages.output_text == r.output_text  # the same prompt, as a message list


def test_stream_matches_create(oai: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = dict(model=model, input="Say hello.", max_output_tokens=16, temperature=0)
    full = oai.responses.create(**kwargs)
    types = []
    with oai.responses.stream(**kwargs) as stream:
        for event in stream:
            types.append(event.type)
        final = stream.get_final_response() if full.status == "completed" else None
    assert types[:2] == ["response.created", "response.in_progress"]
    assert "response.output_item.added" in types and "response.output_text.delta" in types
    assert types[-1] == ("response.completed" if full.status == "completed" else "response.incomplete")
    text = "".join(e.delta for e in oai.responses.create(**kwargs, stream=True)
                   if e.type == "response.output_text.delta")
    assert text == full.output_text
    if final is not None:
        assert final.output_text == full.output_text and final.id != full.id


def test_json_schema_format(oai: openai.OpenAI, model: str) -> None:
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    r = oai.responses.create(model=model, input="Invent a person.", text=fmt, max_output_tokens=60, temperature=0)
    jsonschema.validate(json.loads(r.output_text), PERSON)


def test_tools(oai: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = dict(model=model, input="What is the weather in Paris?", tools=[WEATHER_TOOL],
                                  tool_choice="required", max_output_tokens=60, temperature=0)
    r = oai.responses.create(**kwargs)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_TOOL["parameters"])
    with oai.responses.stream(**kwargs) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    streamed = [o for o in final.output if o.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    # the call and its output in the history
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"sky": "sunny"}'}]
    after = oai.responses.create(model=model, input=history, tools=[WEATHER_TOOL], max_output_tokens=20,
                                 temperature=0)
    assert after.usage.input_tokens > r.usage.input_tokens
    named = oai.responses.create(**{**kwargs, "tool_choice": {"type": "function", "name": "get_weather"}})
    assert [o.name for o in named.output if o.type == "function_call"] == ["get_weather"]


def test_errors(oai: openai.OpenAI, model: str) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        (dict(input="hi", previous_response_id="resp_123"), "previous_response_id"),
        (dict(input=""), "input"),
        (dict(input="hi", max_output_tokens=0), "max_output_tokens"),
        (dict(input="hi", tools=[{"type": "web_search"}]), "tools"),
        (dict(input="hi", tool_choice="required"), "tool_choice"),
        (dict(input="hi", text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}),
         "text.format"),
        (dict(input="hi " * 3000), "input"),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            oai.responses.create(model=model, **body)
        err = info.value.body
        assert isinstance(err, dict) and (err.get("param") or "").startswith(param), (body, err)
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="no-such-model", input="hi")
