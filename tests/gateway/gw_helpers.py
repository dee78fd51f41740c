"""Process helpers for gateway tests: real fake-backend and gateway processes on 127.0.0.1.

Every process is started with a bounded start-up wait and is killed at fixture teardown,
also when a test fails.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Proc:
    proc: subprocess.Popen[str]
    host: str
    port: int
    name: str = ""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes
    http_version: int = 11

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class StreamResult:
    status: int
    headers: dict[str, str]
    events: list[tuple[float, str]] = field(default_factory=list)  # (monotonic arrival s, data)

    def payloads(self) -> list[dict[str, Any]]:
        return [json.loads(d) for _, d in self.events if d != "[DONE]"]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                PYTHONUNBUFFERED="1")


def _drain(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    for _ in proc.stdout:
        pass


def start_process(args: list[str], ready: str = "listening", timeout_s: float = 30.0) -> Proc:
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_env(), cwd=ROOT)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    seen: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if ready in line:
            m = re.search(r"(\d+\.\d+\.\d+\.\d+):(\d+)", line)
            assert m, line
            # drain further output in the background so the pipe never fills up
            threading.Thread(target=_drain, args=(proc,), daemon=True).start()
            return Proc(proc, m.group(1), int(m.group(2)))
    proc.kill()
    proc.wait(5)
    raise RuntimeError(f"process {args} did not start:\n{''.join(seen)}")


class Cluster:
    """Starts fake backends and gateways; ``close`` kills them all."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[Proc] = []
        self._n = 0

    def backend(self, name: str, *flags: str) -> Proc:
        p = start_process(["-m", "hasten.gateway.testing", "--port", "0", "--name", name, *flags])
        p.name = name
        self.procs.append(p)
        return p

    def gateway(self, config: dict[str, Any], *flags: str) -> Proc:
        self._n += 1
        path = self.tmp / f"gateway{self._n}.yaml"
        config = {"listen": "127.0.0.1:0", **config}
        path.write_text(json.dumps(config))
        p = start_process(["-m", "hasten.cli", "gateway", "--config", str(path), "--log-level", "error",
                           *flags])
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            try:
                p.kill()
            except Exception:  # noqa: BLE001 - best effort cleanup
                pass


def request(p: Proc, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
            timeout: float = 10.0) -> Response:
    conn = http.client.HTTPConnection(p.host, p.port, timeout=timeout)
    try:
        data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
        h = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        return Response(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read(), r.version)
    finally:
        conn.close()


def stream(p: Proc, body: dict[str, Any], headers: dict[str, str] | None = None, timeout: float = 10.0,
           path: str = "/v1/chat/completions") -> StreamResult:
    """POST a streaming request and timestamp every SSE ``data:`` line as it arrives."""
    conn = http.client.HTTPConnection(p.host, p.port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps({**body, "stream": True}).encode(),
                     headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        res = StreamResult(r.status, {k.lower(): v for k, v in r.getheaders()})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = r.readline()
            if not line:
                break
            if line.startswith(b"data: "):
                res.events.append((time.monotonic(), line[6:].strip().decode()))
        return res
    finally:
        conn.close()


def chat(content: str, model: str = "smollm2", system: str | None = None, **extra: Any) -> dict[str, Any]:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return {"model": model, "messages": msgs, **extra}


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``hasten_gateway:<name>`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(f"hasten_gateway:{name}"):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] != f"hasten_gateway:{name}":
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def wait_until(fn: Any, timeout_s: float = 10.0, interval_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval_s)
    return last
