"""How many KV blocks a GPU can hold: measured after loading, before the pool exists.

`profile_peak_activation` runs one step of the largest shape the scheduler can produce
(max_num_batched_tokens new tokens, the logits of max_num_seqs rows) over a throw-away pool and
reads the CUDA allocator's peak. `kv_blocks_for_budget` turns the device's memory, the share
granted by gpu_memory_utilization, what is already in use (weights, other processes) and that
peak into a number of blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from hasten.model.dtypes import kv_bytes_per_token, kv_row_width

logger = logging.getLogger(__name__)


@dataclass
class MemoryPlan:
    total_bytes: int  # the device's memory
    budget_bytes: int  # total * gpu_memory_utilization
    in_use_bytes: int  # weights, runtime and other processes, after loading
    peak_activation_bytes: int  # the profiling step's peak above what was allocated before it
    kv_bytes: int  # what is left for the KV pool
    num_blocks: int

    def describe(self, block_size: int) -> str:
        gib = 2**30
        return (f"KV cache: {self.num_blocks} blocks x {block_size} tokens = {self.num_blocks * block_size} tokens "
                f"({self.kv_bytes / gib:.2f} GiB; device {self.total_bytes / gib:.1f} GiB, budget "
                f"{self.budget_bytes / gib:.1f} GiB, in use {self.in_use_bytes / gib:.2f} GiB, peak activations "
                f"{self.peak_activation_bytes / gib:.2f} GiB)")


def kv_blocks_for_budget(total_bytes: int, utilization: float, in_use_bytes: int, peak_activation_bytes: int,
                         bytes_per_block: int, reserve_bytes: int = 0) -> MemoryPlan:
    """Blocks that fit in total * utilization after what is in use, the activation peak and a reserve
    (CUDA graphs' buffers); raises if not one block fits."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(total_bytes * utilization)
    kv = budget - in_use_bytes - peak_activation_bytes - reserve_bytes
    blocks = kv // bytes_per_block if kv > 0 else 0
    if blocks < 1:
        raise RuntimeError(
            f"no room for the KV cache: budget {budget / 2**30:.2f} GiB (gpu_memory_utilization={utilization}) - "
            f"in use {in_use_bytes / 2**30:.2f} GiB - peak activations {peak_activation_bytes / 2**30:.2f} GiB "
            f"leaves {max(kv, 0) / 2**30:.2f} GiB; raise gpu_memory_utilization or lower max_num_batched_tokens")
    return MemoryPlan(total_bytes, budget, in_use_bytes, peak_activation_bytes, blocks * bytes_per_block, blocks)


def profile_peak_activation(step, device: torch.device) -> int:
    """Peak bytes allocated while `step()` runs, above what was allocated before it (CUDA only)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return max(0, peak)


def plan_device_kv(device: torch.device, utilization: float, bytes_per_block: int, peak_activation_bytes: int,
                   reserve_bytes: int = 0) -> MemoryPlan:
    """The plan for a CUDA device as it is now (weights loaded, the profiling step done)."""
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free  # this process's weights and runtime, and any other process on the device
    return kv_blocks_for_budget(total, utilization, in_use, peak_activation_bytes, bytes_per_block, reserve_bytes)


def plan_kv_cache(model, cfg, config, kv_dtype: torch.dtype, max_model_len: int, device: torch.device,
                  attention_backend: str, step_tokens: int) -> MemoryPlan:
    """Profile the largest step on a throw-away pool, then size the KV pool (CUDA only).

    The step: one sequence of min(step_tokens (the token budget), max_model_len) new tokens through the
    decoder, then the logits of max_num_seqs rows (what the sampler gets at most); the throw-away
    pool's own bytes are not counted as activations."""
    from hasten.model.layers import single_sequence_metadata

    bs = config.block_size
    tokens = min(step_tokens, max_model_len)
    shape = (-(-tokens // bs), bs, cfg.num_kv_heads, kv_row_width(cfg.head_dim, kv_dtype))
    pool_bytes = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype) * shape[0] * bs

    def step() -> None:
        caches = [(torch.zeros(shape, dtype=kv_dtype, device=device), torch.zeros(shape, dtype=kv_dtype, device=device))
                  for _ in range(cfg.num_layers)]
        meta = single_sequence_metadata(tokens, bs, attention_backend)
        meta = _metadata_to(meta, device)
        ids = torch.zeros(tokens, dtype=torch.long, device=device)
        pos = torch.arange(tokens, device=device)
        with torch.inference_mode():
            hidden = model.forward(ids, pos, meta, caches)
            model.logits(hidden[: min(config.max_num_seqs, tokens)])

    peak = max(0, profile_peak_activation(step, device) - pool_bytes)
    per_block = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype) * bs
    graphs = config.cuda_graphs and not config.enforce_eager
    return plan_device_kv(device, config.gpu_memory_utilization, per_block, peak, reserve_bytes=2**28 if graphs else 0)


def _metadata_to(meta, device: torch.device):
    from dataclasses import fields, replace

    from hasten.model.layers import AttentionGroup

    def move(v):
        if isinstance(v, torch.Tensor):
            return v.to(device)
        if isinstance(v, list) and v and isinstance(v[0], AttentionGroup):
            return [replace(g, **{f.name: move(getattr(g, f.name)) for f in fields(g) if f.name != "window_masks"})
                    for g in v]
        return v

    return replace(meta, **{f.name: move(getattr(meta, f.name)) for f in fields(meta)})
