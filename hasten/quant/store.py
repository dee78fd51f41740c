"""Save and load quantized weights: one safetensors file plus JSON metadata in its header.

Tensors are stored per layer name: `{name}.qweight`, `{name}.scales`, and for int4
`{name}.mins`; `{name}.input_scale` when AWQ chose one. The layout is ours (not the kernel's
packed one), so a file stays valid across torch versions. The header metadata records the
format version, the options and each layer's kind and group size.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hasten.quant.formats import Int4Weight, Int8Weight, QuantizedWeight

FORMAT = "hasten-quant-v1"


def save_quantized(path: Path, weights: dict[str, QuantizedWeight], options: dict) -> None:
    tensors: dict[str, torch.Tensor] = {}
    layers: dict[str, dict] = {}
    for name, qw in weights.items():
        tensors[f"{name}.qweight"] = qw.qweight.contiguous()
        tensors[f"{name}.scales"] = qw.scales.float().contiguous()
        if isinstance(qw, Int4Weight):
            tensors[f"{name}.mins"] = qw.mins.float().contiguous()
            layers[name] = {"kind": "int4", "group_size": qw.group_size}
        else:
            layers[name] = {"kind": "int8"}
        if qw.input_scale is not None:
            tensors[f"{name}.input_scale"] = qw.input_scale.float().contiguous()
    meta = {"format": FORMAT, "options": json.dumps(options, sort_keys=True), "layers": json.dumps(layers, sort_keys=True)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)


def load_quantized(path: Path) -> tuple[dict[str, QuantizedWeight], dict]:
    """(layer name -> weight, options) from a file written by `save_quantized`."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not a {FORMAT} file")
        layers = json.loads(meta["layers"])
        keys = set(f.keys())
        out: dict[str, QuantizedWeight] = {}
        for name, info in layers.items():
            q = f.get_tensor(f"{name}.qweight")
            scales = f.get_tensor(f"{name}.scales")
            inp = f.get_tensor(f"{name}.input_scale") if f"{name}.input_scale" in keys else None
            if info["kind"] == "int4":
                out[name] = Int4Weight(q, scales, f.get_tensor(f"{name}.mins"), int(info["group_size"]), None, inp)
            else:
                out[name] = Int8Weight(q, scales, None, inp)
    return out, json.loads(meta["options"])
