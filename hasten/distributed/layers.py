"""The tensor-parallel decoder: a rank's shard of the model plus the collectives between its shards.

Column-parallel projections (q/k/v, gate/up) need nothing: each rank computes its own heads and rows.
Row-parallel ones (o, down) are wrapped in `RowParallelLinear`, whose partial outputs are summed by one
all-reduce. The embedding looks up the rank's vocabulary rows (zeros elsewhere) and all-reduces; the
lm_head gives the rank's logit columns, gathered into the full vocabulary. Quantized layers are the
same int8 / int4 layouts, sharded (`ShardQuantFactory`): a shard's int4 groups are the full layer's
groups, and a row-parallel int8 shard keeps the full rows' scales, so every rank's codes are exactly
the slice of the single-rank layer's codes.
"""

from __future__ import annotations

from typing import Any

import torch

from hasten.distributed.group import ParallelGroup
from hasten.distributed.sharding import ShardedState, ShardPlan, StagePlan, row_parallel_source, stage_factory
from hasten.model.decoder import Decoder
from hasten.model.linear import LinearFactory, LinearLayer


class RowParallelLinear:
    """y = all_reduce(x_shard W_shard^T) (+ bias on rank 0 only, already left out of the other shards)."""

    def __init__(self, inner: LinearLayer, group: ParallelGroup):
        self.inner = inner
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        if not y.is_contiguous():
            y = y.contiguous()
        return self.group.all_reduce(y)

    def __getattr__(self, name: str) -> Any:  # bf16_weight, nbytes, ... of the wrapped layer
        if name in ("inner", "group"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def parallel_factory(inner: LinearFactory, group: ParallelGroup) -> LinearFactory:
    """`inner`'s layers, the row-parallel ones (o_proj, down_proj) wrapped to all-reduce."""
    if group.tp_size == 1:
        return inner

    def make(name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearLayer:
        layer = inner(name, weight, bias)
        return RowParallelLinear(layer, group) if row_parallel_source(name) is not None else layer

    return make


class ShardQuantFactory:
    """int8 / int4 (round-to-nearest) layers of a rank's shards, the same codes as the full layer's slice."""

    def __init__(self, config: Any, state: ShardedState, world: int):
        from hasten.quant.factory import QuantOptions

        self.opts = QuantOptions.from_config(config)
        if self.opts.mode not in ("int8", "int4"):
            raise ValueError(f"tensor parallelism serves quantization int8 or int4, not {self.opts.mode!r} "
                             "(a GGUF's own blocks are not sharded yet: convert it without --quantization gguf)")
        if self.opts.method != "rtn":
            raise ValueError("tensor parallelism quantizes with quant_method='rtn' (AWQ calibrates the whole model)")
        self.state = state
        self.world = world

    def __call__(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearLayer:
        from hasten.model.linear import DenseLinear
        from hasten.quant.formats import int8_scales, pick_group_size, quantize_int4, quantize_int8
        from hasten.quant.kernels import make_layer

        o = self.opts
        if name == "lm_head" and not o.quantize_lm_head:
            return DenseLinear(weight, bias)
        source = row_parallel_source(name)
        if o.mode == "int8":
            scales = None
            if source is not None and self.world > 1:  # the full rows' scales (one layer read transiently,
                scales = int8_scales(self.state.full(source).to(weight.dtype))  # as the one-rank layer sees it)
            qw = quantize_int8(weight, scales=scales)
        else:
            full_k = weight.shape[1] * (self.world if source is not None else 1)
            group = pick_group_size(full_k, o.group_size)  # the single-rank layer's group
            if weight.shape[1] % group:
                raise ValueError(f"{name}: the int4 group of {group} does not divide this rank's {weight.shape[1]} "
                                 "input columns; pick a smaller quant_group_size or tensor-parallel size")
            qw = quantize_int4(weight, group, o.symmetric)
        qw.bias = bias
        return make_layer(qw, o.max_kernel_rows, o.int4_kernel, o.int8_kernel, q8_gemm=o.q8_gemm, **o.wide_options())


class ParallelDecoder(Decoder):
    """A Decoder over one rank's part of the model: its tensor-parallel shards (vocab-parallel embedding
    and logits, all-reducing o/down) of its pipeline stage's layers (from the received residual stream,
    to the residual stream before the last stage)."""

    def __init__(self, plan: ShardPlan, state: ShardedState, group: ParallelGroup, dtype: torch.dtype,
                 max_len: int, linear_factory: LinearFactory, stage: StagePlan | None = None, **options: Any):
        self.plan = plan
        self.stage = stage
        self.group = group
        self.hidden_in: torch.Tensor | None = None  # a later stage's input: the residual stream it received
        self.vocab_lo, self.vocab_hi = plan.vocab_rows()
        options["native_loop"] = False  # the C++ loop looks up the whole embedding itself
        cfg = plan.local_config()
        factory = parallel_factory(linear_factory, group)
        if stage is not None:
            cfg, factory = stage.local_config(cfg), stage_factory(factory, stage)
        super().__init__(cfg, state, dtype, max_len, factory, **options)
        self.returns_residual = stage is not None and not stage.last

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.stage is not None and not self.stage.first:
            assert self.hidden_in is not None
            return self.hidden_in
        local = input_ids - self.vocab_lo
        mine = (local >= 0) & (local < self.vocab_hi - self.vocab_lo)
        h = self.embed[local.clamp(0, max(0, self.embed.shape[0] - 1))] if self.embed.shape[0] else \
            self.embed.new_zeros(input_ids.shape[0], self.cfg.hidden_size)
        h = h * mine.unsqueeze(1).to(h.dtype)
        h = self.group.all_reduce(h.contiguous())
        return h * self.embed_scale if self.embed_scale is not None else h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.lm_head(hidden).float()
        return self._finish_logits(self.group.all_gather_cols(local, self.plan.vocab_step, self.plan.cfg.vocab_size))


def decoder_weight_bytes(model: Decoder) -> int:
    def tensor_bytes(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.numel() * t.element_size()

    def layer_bytes(layer: Any) -> int:
        if layer is None:
            return 0
        n = getattr(layer, "nbytes", None)
        if n is not None:
            return int(n)
        return tensor_bytes(getattr(layer, "weight", None)) + tensor_bytes(getattr(layer, "bias", None))

    total = tensor_bytes(model.embed) + tensor_bytes(model.final_norm)
    if getattr(model.lm_head, "weight", None) is not model.embed:
        total += layer_bytes(model.lm_head)
    for lw in model.layers:
        total += sum(layer_bytes(p) for p in (lw.qkv_proj, lw.o_proj, lw.gate_up_proj, lw.down_proj))
        total += sum(tensor_bytes(t) for t in (lw.input_norm, lw.post_norm, lw.q_norm, lw.k_norm,
                                                 lw.attn_out_norm, lw.mlp_out_norm))
    return total
