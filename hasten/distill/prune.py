"""Layer pruning by block influence: which decoder layers change the hidden state least, and a copy
of the model without them.

Block influence (ShortGPT, Men et al. 2024) of layer i is 1 - cos(x_i, x_{i+1}) averaged over the
tokens of calibration text, where x_i is the residual stream entering layer i: a layer whose output
points where its input did adds little and is the first to go. The pruned model is the same
transformers class with fewer layers (renumbered, per-layer config lists such as `layer_types`
sliced), saved as a normal Hugging Face folder that hasten and transformers both load.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def decoder_layers(model: Any) -> torch.nn.ModuleList:
    """The decoder layers of a transformers causal LM (model.model.layers for every served family)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no model.layers: not a decoder-only model hasten prunes")
    return layers


@torch.no_grad()
def block_influence(model: Any, sequences: Sequence[Sequence[int]]) -> list[float]:
    """Each layer's mean 1 - cos(input, output) over every token of `sequences`."""
    layers = decoder_layers(model)
    sums = [0.0] * len(layers)
    count = 0

    def hook(i: int):
        def record(module, args, kwargs, output):
            x = args[0] if args else kwargs["hidden_states"]
            y = output[0] if isinstance(output, tuple) else output
            cos = torch.nn.functional.cosine_similarity(x.float().flatten(0, -2), y.float().flatten(0, -2), dim=-1)
            sums[i] += float((1.0 - cos).sum())

        return record

    handles = [layer.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        model.eval()
        for ids in sequences:
            model(torch.tensor([list(ids)]), use_cache=False)
            count += len(ids)
    finally:
        for h in handles:
            h.remove()
    if count == 0:
        raise ValueError("block influence needs at least one calibration token")
    return [s / count for s in sums]


def least_influential(scores: Sequence[float], k: int) -> list[int]:
    """The k layers with the lowest scores, in layer order (ties: the later layer goes first)."""
    if not 0 < k < len(scores):
        raise ValueError(f"--layers must be between 1 and {len(scores) - 1} for a {len(scores)}-layer model, not {k}")
    order = sorted(range(len(scores)), key=lambda i: (scores[i], -i))
    return sorted(order[:k])


def remove_layers(model: Any, drop: Sequence[int]) -> Any:
    """`model` with the layers in `drop` removed (in place): the rest renumbered, the config's layer
    count and per-layer lists updated."""
    layers = decoder_layers(model)
    n = len(layers)
    drop_set = set(drop)
    if not drop_set or min(drop_set) < 0 or max(drop_set) >= n or len(drop_set) >= n:
        raise ValueError(f"cannot remove layers {sorted(drop_set)} of {n}")
    keep = [i for i in range(n) if i not in drop_set]
    kept = torch.nn.ModuleList([layers[i] for i in keep])
    for j, layer in enumerate(kept):  # the KV-cache index each attention layer writes to
        for mod in (layer, getattr(layer, "self_attn", None)):
            if mod is not None and hasattr(mod, "layer_idx"):
                mod.layer_idx = j
    model.model.layers = kept
    cfg = model.config
    cfg.num_hidden_layers = len(keep)
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, list) and len(types) == n:  # one entry per layer (sliding / full attention)
        cfg.layer_types = [types[i] for i in keep]
    step = getattr(cfg, "decoder_sparse_step", None)
    if step is not None:  # Qwen3-MoE: dense where listed in mlp_only_layers or where (i + 1) % step != 0
        mlp_only = set(getattr(cfg, "mlp_only_layers", None) or [])
        dense = [j for j, i in enumerate(keep) if i in mlp_only or (i + 1) % step != 0]
        cfg.mlp_only_layers, cfg.decoder_sparse_step = dense, 1  # the kept layers' kinds, spelled out
    return model


@torch.no_grad()
def mlp_channel_importance(model: Any, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Per layer, the mean |act(gate) * up| of each MLP channel over the tokens of `sequences` (what
    the down projection receives: a channel that is always near 0 contributes little)."""
    layers = decoder_layers(model)
    sums: list[torch.Tensor | None] = [None] * len(layers)

    def hook(i: int):
        def record(module, args):
            a = args[0].detach().float().abs().flatten(0, -2).sum(0)
            sums[i] = a if sums[i] is None else sums[i] + a

        return record

    handles = []
    for i, layer in enumerate(layers):
        down = getattr(getattr(layer, "mlp", None), "down_proj", None)
        if not isinstance(down, torch.nn.Linear):
            raise ValueError(f"layer {i} has no dense MLP (gate/up -> down_proj): MLP narrowing covers dense models")
        handles.append(down.register_forward_pre_hook(hook(i)))
    try:
        model.eval()
        for ids in sequences:
            model(torch.tensor([list(ids)]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [s if s is not None else torch.zeros(1) for s in sums]


def _rows(linear: torch.nn.Linear, idx: torch.Tensor) -> torch.nn.Linear:
    out = torch.nn.Linear(linear.in_features, len(idx), bias=linear.bias is not None, dtype=linear.weight.dtype)
    out.weight.copy_(linear.weight[idx])
    if linear.bias is not None:
        out.bias.copy_(linear.bias[idx])
    return out


@torch.no_grad()
def narrow_mlps(model: Any, importance: Sequence[torch.Tensor], keep: int) -> Any:
    """Every layer's MLP cut to its `keep` most important channels (gate/up rows and down columns;
    Phi-3's fused gate_up too); config.intermediate_size becomes `keep` (one width for all layers)."""
    cfg = model.config
    inter = cfg.intermediate_size
    if not 0 < keep <= inter:
        raise ValueError(f"cannot keep {keep} of {inter} MLP channels")
    for layer, imp in zip(decoder_layers(model), importance, strict=True):
        mlp = layer.mlp
        idx = imp.topk(keep).indices.sort().values
        if hasattr(mlp, "gate_up_proj"):  # [gate; up] in one matrix
            mlp.gate_up_proj = _rows(mlp.gate_up_proj, torch.cat([idx, idx + inter]))
        else:
            mlp.gate_proj, mlp.up_proj = _rows(mlp.gate_proj, idx), _rows(mlp.up_proj, idx)
        down = mlp.down_proj
        new = torch.nn.Linear(keep, down.out_features, bias=down.bias is not None, dtype=down.weight.dtype)
        new.weight.copy_(down.weight[:, idx])
        if down.bias is not None:
            new.bias.copy_(down.bias)
        mlp.down_proj = new
        for name in ("intermediate_size", "intermediate_dim"):
            if hasattr(mlp, name):
                setattr(mlp, name, keep)
    cfg.intermediate_size = keep
    return model
