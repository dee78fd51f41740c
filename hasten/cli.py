"""Command line entry point: `hasten serve | bench | gateway | eval-ppl | distill | generate | models`.

Each sub-command lives in its own module and is imported lazily, so `hasten bench`
does not pay for importing torch.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "serve": ("hasten.server.cli", "Serve a model with an OpenAI-compatible HTTP API"),
    "generate": ("hasten.engine.cli", "Generate text offline from the command line"),
    "bench": ("hasten.bench.cli", "Load-test any OpenAI-compatible server"),
    "gateway": ("hasten.gateway.cli", "Run the gateway in front of many replicas"),
    "eval-ppl": ("hasten.quant.cli", "Perplexity and top-1 agreement of a (quantized) model"),
    "distill": ("hasten.distill.cli", "Prune layers and heal by distillation, or train an EAGLE draft head (hasten distill prune | draft)"),
    "models": ("hasten.model.cli", "List the supported model architectures and GGUF block types"),
}


def _usage() -> str:
    lines = ["usage: hasten COMMAND [ARGS...]  |  hasten --version", "", "commands:"]
    for name, (_, help_text) in COMMANDS.items():
        lines.append(f"  {name:<10} {help_text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from hasten import __version__

        print(f"hasten {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"hasten: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    result = module.main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
