"""Tool calling on /v1/chat/completions: the parsers on text, the constrained calls (`required`, a named
function) with the official SDK on the default model, a history with tool results, and `auto` end to end on
a tiny model and a scripted engine whose chat templates have the Hermes tool format."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from hasten.server.protocol import ChatTool, NamedToolChoice
from hasten.server.tool_parsers import ToolStream, parse_forced, parse_tool_calls, parser_for_template
from hasten.server.tools import plan_tools

from .default_model import default_server
from .fake_engine import FakeAsyncLLM, make_tokenizer
from .harness import ServerThread

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string",
           "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMES = {"get_weather", "add"}
# A Hermes / Qwen-style template: the tools in the system turn, calls in <tool_call> tags.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n<tools>\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}</tools>\nCall one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ---------------------------------------------------------------------------------- parsers on text


def test_hermes_parser() -> None:
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    content, calls = parse_tool_calls("hermes", text, NAMES)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                   ("add", {"a": 1, "b": 2})]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    # unknown tool, broken JSON, or text after the call: all plain content
    for bad in ['<tool_call>{"name": "rm", "arguments": {}}</tool_call>', '<tool_call>{"name": "add", "argu',
                '<tool_call>{"name": "add", "arguments": {}}</tool_call> and more', "just text"]:
        assert parse_tool_calls("hermes", bad, NAMES) == (bad, [])
    # an unclosed last call (the stop token came first) still counts
    assert parse_tool_calls("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}}', NAMES)[1][0].name == "add"


def test_llama3_parser() -> None:
    content, calls = parse_tool_calls("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                                                     '{"name": "add", "parameters": {"a": 1, "b": 2}}', NAMES)
    assert content is None and [c.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
    assert parse_tool_calls("llama3_json", '<|python_tag|>{"name": "add", "parameters": {}}', NAMES)[1][0].name == "add"
    assert parse_tool_calls("llama3_json", 'The answer is {"name": "add"}', NAMES)[1] == []
    assert parse_tool_calls("llama3_json", '{"name": "add", "parameters": [1]}', NAMES)[1] == []


def test_parser_for_template() -> None:
    assert parser_for_template(HERMES_TEMPLATE) == "hermes"
    assert parser_for_template("{{ '<|python_tag|>' }}{% if tools %}{% endif %}") == "llama3_json"
    assert parser_for_template(make_tokenizer().chat_template) is None


@pytest.mark.parametrize("parser,text", [
    ("hermes", 'Sure. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'),
    ("hermes", "No tool needed, <tool_ here: a < b."),
    ("llama3_json", '  {"name": "add", "parameters": {"a": 1, "b": 2}}'),
    ("llama3_json", "Plain {answer}."),
    (None, '[{"name": "add", "arguments": {"a": 1, "b": 2}}]'),
])
def test_tool_stream_matches_whole_text(parser: str | None, text: str) -> None:
    """Whatever the deltas, a stream gives the same content and calls as the whole text."""
    for size in (1, 3, 7, len(text)):
        stream = ToolStream(parser, NAMES)
        sent = "".join(stream.feed(text[i:i + size]) for i in range(0, len(text), size))
        rest, calls = stream.finish()
        if parser is None:
            expected = parse_forced(text, NAMES)
            assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in expected]
            continue
        content, expected = parse_tool_calls(parser, text, NAMES)
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in expected]
        if expected:
            assert "<tool_call>" not in sent + rest and (sent + rest).strip() == (content or "")
        else:
            assert sent + rest == text


def test_plan_schemas_and_errors() -> None:
    tools = [ChatTool.model_validate(t) for t in TOOLS]
    plan = plan_tools(tools, NamedToolChoice.model_validate({"type": "function", "function": {"name": "add"}}),
                      True, None, None)
    assert plan is not None and plan.choice == "forced"
    schema = plan.grammar.json_schema.schema_  # type: ignore[union-attr]
    assert schema["properties"]["name"] == {"const": "add"} and schema["properties"]["arguments"] == ADD
    plan = plan_tools(tools, "required", True, None, None)
    schema = plan.grammar.json_schema.schema_  # type: ignore[union-attr]
    assert schema["type"] == "array" and len(schema["items"]["anyOf"]) == 2
    jsonschema.validate([{"name": "add", "arguments": {"a": 1, "b": 2}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "add", "arguments": {"city": "x"}}], schema)
    assert plan_tools(tools, "none", True, None, None) is None
    auto = plan_tools(tools, None, True, None, None)
    assert auto is not None and auto.choice == "auto" and auto.parser == "hermes"


# ---------------------------------------------------------------------------------- the default model


@pytest.fixture(scope="module")
def smol(request: pytest.FixtureRequest) -> ServerThread:
    return default_server(request)


@pytest.fixture(scope="module")
def oai(smol: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=smol.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _model(oai: openai.OpenAI) -> str:
    return oai.models.list().data[0].id


def _check_calls(calls: Any, names: set[str]) -> list[tuple[str, dict]]:
    assert calls
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def test_required_and_named(oai: openai.OpenAI) -> None:
    model = _model(oai)
    r = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                    temperature=0, max_tokens=120)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    _check_calls(r.choices[0].message.tool_calls, NAMES)
    named = {"type": "function", "function": {"name": "add"}}
    r = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is 2 + 3?"}],
                                    tools=TOOLS, tool_choice=named, temperature=0, max_tokens=120)
    assert [c[0] for c in _check_calls(r.choices[0].message.tool_calls, {"add"})] == ["add"]


def test_stream_assembles_to_the_same_call(oai: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=_model(oai), messages=ASK, tools=TOOLS, temperature=0, max_tokens=120,
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    full = oai.chat.completions.create(**kwargs).choices[0].message.tool_calls
    with oai.chat.completions.stream(**kwargs) as stream:  # the SDK's own assembly of tool-call deltas
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    streamed = final.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in full]
    heads = [c.choices[0].delta.tool_calls[0] for c in oai.chat.completions.create(**kwargs, stream=True)
             if c.choices and c.choices[0].delta.tool_calls]
    assert heads[0].id and heads[0].function.name == "get_weather" and heads[0].function.arguments == ""


def test_history_with_tool_results(oai: openai.OpenAI) -> None:
    model = _model(oai)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'}]
    r = oai.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=40)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    plain = oai.chat.completions.create(model=model, messages=messages[:1], tools=TOOLS, max_tokens=1)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the call and its result are in the prompt


def test_bad_tool_requests(smol: ServerThread) -> None:
    with smol.client() as c:
        def post(**body: Any) -> httpx.Response:
            return c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})

        cases = [
            (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
            (dict(tool_choice="required"), "tool_choice"),
            (dict(tools=[TOOLS[0], TOOLS[0]]), "tools"),
            (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools"),
            (dict(tools=[{"type": "retrieval"}]), "tools"),
            (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}],
                  tool_choice="required"), "tools"),
            (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format"),
        ]
        for body, param in cases:
            r = post(**body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and (err["param"] or "").startswith(param), (body, err)


# ---------------------------------------------------------------------------------- auto, Hermes template


class ScriptedEngine(FakeAsyncLLM):
    """The fake engine (tests/server/fake_engine.py) writing one fixed answer at temperature 0."""

    def __init__(self, answer: str) -> None:
        tokenizer = make_tokenizer()
        tokenizer.chat_template = HERMES_TEMPLATE
        super().__init__(tokenizer=tokenizer, max_model_len=4096)
        self._script = self.tokenizer.encode(answer, add_special_tokens=False)
        self.eos_after = len(self._script)


@pytest.fixture(scope="module")
def scripted() -> Iterator[ServerThread]:
    answer = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}' \
             '</tool_call>'
    with ServerThread(lambda: ScriptedEngine(answer)) as srv:
        yield srv


def test_auto_parses_the_models_tool_call(scripted: ServerThread) -> None:
    oai = openai.OpenAI(base_url=scripted.url + "/v1", api_key="x", max_retries=0)
    kwargs: dict[str, Any] = dict(model="fake-model", messages=ASK, tools=TOOLS, temperature=0, max_tokens=200)
    r = oai.chat.completions.create(**kwargs)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Checking."
    assert _check_calls(msg.tool_calls, NAMES) == [("get_weather", {"city": "Oslo", "unit": "celsius"})]
    with oai.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == "Checking."
    assert _check_calls(final.message.tool_calls, NAMES) == [("get_weather", {"city": "Oslo", "unit": "celsius"})]
    # tool_choice "none": the same text, not parsed
    r = oai.chat.completions.create(**kwargs, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in (r.choices[0].message.content or "")


@pytest.fixture(scope="module")
def tiny_hermes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    from hasten.engine.async_engine import AsyncLLM
    from hasten.testing import make_tiny_model

    path: Path = make_tiny_model(tmp_path_factory.mktemp("hermes") / "llama", arch="llama")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = HERMES_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    with ServerThread(lambda: AsyncLLM.from_options(str(path), dtype="float32", max_model_len=1024,
                                                    num_kv_blocks=128, num_threads=1)) as srv:
        yield srv


def test_auto_on_a_tiny_hermes_model(tiny_hermes: ServerThread) -> None:
    tokenizer = tiny_hermes.engine.tokenizer
    assert parser_for_template(tokenizer.chat_template) == "hermes"
    oai = openai.OpenAI(base_url=tiny_hermes.url + "/v1", api_key="x", max_retries=0)
    model = oai.models.list().data[0].id
    with_tools = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=8)
    without = oai.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=8)
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + 50  # the template rendered the tools
    assert with_tools.choices[0].finish_reason in ("stop", "length", "tool_calls")
    forced = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=200,
                                         tool_choice={"type": "function", "function": {"name": "add"}})
    assert forced.choices[0].finish_reason in ("tool_calls", "length")  # a random model may run out first
    if forced.choices[0].finish_reason == "tool_calls":
        _check_calls(forced.choices[0].message.tool_calls, {"add"})
