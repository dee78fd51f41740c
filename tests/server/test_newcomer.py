"""What a newcomer hits first: load failures, bad -O options, --version, engine-process logs, --chat-template,
LLM(use_tqdm=..., get_tokenizer()), and `hasten bench` without --model or with a wrong one."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from hasten.bench.cli import main as bench_main
from hasten.bench.fake_server import FakeServerConfig, ServerThread

pytestmark = pytest.mark.slow  # starts processes or loads the embedded model

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hasten(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hasten.cli", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hasten.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_version() -> None:
    r = hasten("--version", timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"hasten {__import__('hasten').__version__}"


def test_model_that_fails_to_load_exits_1_with_one_line(tmp_path: Path) -> None:
    r = hasten("serve", str(tmp_path / "no-such-model"), "--port", str(free_port()))
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "no-such-model" in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def test_unknown_engine_option_exits_before_listening() -> None:
    r = hasten("serve", "-O", "max_num_seq=4", "--port", str(free_port()), timeout=60)
    assert r.returncode == 2
    assert "unknown engine option(s) max_num_seq" in r.stderr and "max_num_seqs" in r.stderr
    assert "listening" not in r.stderr + r.stdout
    r = hasten("serve", "--task", "embed", "-O", "dtype='float16'", timeout=60)
    assert r.returncode == 2 and "num_threads" in r.stderr
    r = hasten("serve", "-O", "gc_freeze=maybe", "--port", str(free_port()), timeout=60)
    assert r.returncode == 2 and "gc_freeze must be True or False, not 'maybe'" in r.stderr, r.stderr


def test_bad_chat_template_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    r = hasten("serve", "--chat-template", str(bad), timeout=60)
    assert r.returncode == 2 and "not a valid Jinja template" in r.stderr


def test_engine_process_logs_and_chat_template(tiny: Path, tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "hasten.cli", "serve", str(tiny), "--port", str(port),
                                 "--chat-template", str(template), "--max-model-len", "256"],
                                cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT)
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
        ids = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
        text = httpx.post(url + "/detokenize", json={"tokens": ids}).json()["prompt"]
        assert text == "<user>hi"
    finally:
        proc.kill()
        proc.wait(10)
    text = log.read_text()
    # the engine's own lines, from the child process, in the server's format
    assert any("INFO hasten.engine.engine [-] loaded" in line and "KV blocks" in line
               for line in text.splitlines()), text


def test_llm_use_tqdm_and_get_tokenizer(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hasten import LLM, SamplingParams

    llm = LLM(str(tiny), max_model_len=128)
    assert llm.get_tokenizer() is llm.tokenizer and llm.get_tokenizer().encode("hello")
    params = SamplingParams(max_tokens=2, temperature=0)
    capsys.readouterr()
    quiet = llm.generate(["a", "b"], params, use_tqdm=False)
    assert len(quiet) == 2 and "Processed prompts" not in capsys.readouterr().err
    loud = llm.generate(["a", "b", "c"], params, use_tqdm=True)
    err = capsys.readouterr().err
    assert len(loud) == 3 and "Processed prompts" in err and "3/3" in err
    chat = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)
    assert len(chat) == 1 and "Processed prompts" not in capsys.readouterr().err


def test_bench_without_model_asks_the_server(capsys: pytest.CaptureFixture[str]) -> None:
    with ServerThread(FakeServerConfig(ttft_ms=1, itl_ms=1, model="served-x", strict_model=True)) as srv:
        rc = bench_main(["--base-url", srv.base_url, "--num-requests", "3", "--output-len", "2", "--input-len", "4"])
    out = capsys.readouterr()
    assert rc == 0
    assert "Successful requests:" in out.out and "Failed requests:                        0" in out.out
    assert "model 'served-x'" in out.err


def test_bench_prints_error_details(capsys: pytest.CaptureFixture[str]) -> None:
    with ServerThread(FakeServerConfig(ttft_ms=1, itl_ms=1, model="served-x", strict_model=True)) as srv:
        rc = bench_main(["--base-url", srv.base_url, "--model", "default", "--num-requests", "3",
                         "--output-len", "2", "--warmup", "0"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "http_404:" in out and "e.g. http_404: The model `default` does not exist." in out
