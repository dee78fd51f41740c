"""`hasten serve --attention-backend triton` on the CPU: the server over the engine's GPU code path
(device runner, Triton kernels in the interpreter, device sampler), in the engine process as it is
served. Greedy chat equals the CPU path's answer token for token, streaming equals non-streaming,
structured output's token masks apply on the device sampler's rows, and the metrics are there."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from hasten.kernels import triton as triton_kernels
from tests.server.harness import ServerThread

pytestmark = [pytest.mark.skipif(not triton_kernels.usable_on("cpu"),
                                 reason="the Triton kernels run on the CPU only under TRITON_INTERPRET=1"),
              pytest.mark.slow]

OPTIONS = dict(dtype="float32", max_model_len=256, max_num_seqs=4, num_kv_blocks=64, num_threads=1)
MSG = [{"role": "user", "content": "Tell me about foxes."}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from hasten.testing import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama"))


def _serve(model: str, **options) -> ServerThread:
    from hasten.server.engine_process import ProcessEngine

    return ServerThread(lambda: ProcessEngine.from_options(model, **{**OPTIONS, **options}))


@pytest.fixture(scope="module")
def triton_server(tiny) -> Iterator[ServerThread]:
    with _serve(tiny, attention_backend="triton") as srv:
        yield srv


def _client(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _chat(srv: ServerThread, **kw):
    oai = _client(srv)
    return oai.chat.completions.create(model=oai.models.list().data[0].id, messages=MSG, temperature=0,
                                       extra_body={"ignore_eos": True}, **kw)


def test_greedy_chat_equals_the_cpu_path_and_streaming_equals_whole(tiny, triton_server):
    got = _chat(triton_server, max_tokens=10)
    assert got.usage.completion_tokens == 10 and got.choices[0].finish_reason == "length"
    chunks = list(_chat(triton_server, max_tokens=10, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == got.choices[0].message.content
    with _serve(tiny, attention_backend="cpp") as cpu:
        want = _chat(cpu, max_tokens=10)
    assert got.choices[0].message.content == want.choices[0].message.content


def test_structured_output_and_metrics_on_the_device_path(triton_server):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "ok": {"type": "boolean"}}, "required": ["color", "ok"]}
    oai = _client(triton_server)
    resp = oai.chat.completions.create(
        model=oai.models.list().data[0].id, messages=MSG, max_tokens=40, temperature=1.0, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}})
    assert resp.choices[0].finish_reason == "stop", resp
    jsonschema.validate(json.loads(resp.choices[0].message.content), schema)
    with triton_server.client() as c:
        metrics = c.get("/metrics").text
        assert "hasten:time_to_first_token_seconds_count" in metrics
        assert c.get("/health").status_code == 200
