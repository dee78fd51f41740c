"""`hasten models`: the model architectures hasten serves, and what it reads from GGUF files."""

from __future__ import annotations

import argparse
import json
from typing import Any


def supported_models() -> dict[str, Any]:
    """The supported HF architectures (by family), GGUF architectures and GGUF tensor types."""
    from hasten.model.config import FAMILY_MODELS, SUPPORTED_ARCHS
    from hasten.model.gguf_convert import GGUF_ARCHS
    from hasten.quant.gguf_blocks import FLOAT_TYPES, NATIVE_TYPES

    return {
        "architectures": [{"architecture": arch, "family": family, "models": FAMILY_MODELS[family]}
                          for arch, family in SUPPORTED_ARCHS.items()],
        "gguf_architectures": [{"gguf": name, "architecture": arch} for name, arch in GGUF_ARCHS.items()],
        "gguf_native_block_types": list(NATIVE_TYPES),
        "gguf_float_types": list(FLOAT_TYPES),
    }


def format_table(info: dict[str, Any]) -> str:
    width = max(len(a["architecture"]) for a in info["architectures"])
    lines = ["Hugging Face architectures (config.json + safetensors):"]
    lines += [f"  {a['architecture']:<{width}}  {a['models']}" for a in info["architectures"]]
    lines.append("")
    lines.append("GGUF architectures (converted once into a cached HF folder):")
    lines += [f"  {g['gguf']:<{width}}  -> {g['architecture']}" for g in info["gguf_architectures"]]
    lines.append("")
    lines.append(f"GGUF block types served natively (--quantization gguf): {', '.join(info['gguf_native_block_types'])}")
    lines.append(f"GGUF float types (served dense): {', '.join(info['gguf_float_types'])}")
    lines.append("Other GGUF types are dequantized at conversion (and requantized to int8 under --quantization gguf).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hasten models", description=__doc__)
    ap.add_argument("--json", action="store_true", help="print the lists as JSON")
    args = ap.parse_args(argv)
    info = supported_models()
    print(json.dumps(info, indent=2) if args.json else format_table(info))
    return 0
