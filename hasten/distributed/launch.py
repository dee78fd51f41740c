"""Rank 0's side of starting tensor or pipeline parallelism: start or meet the other ranks, then build its part."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from hasten.distributed.group import (
    ParallelGroup,
    TensorParallelError,
    external_launch,
    free_port,
    threads_per_rank,
)
from hasten.distributed.layers import decoder_weight_bytes
from hasten.distributed.sharding import ShardPlan, StagePlan
from hasten.distributed.worker import WorkerSpec, build_rank_model
from hasten.model.config import ModelConfig
from hasten.model.decoder import Decoder

logger = logging.getLogger(__name__)


def parallel_layout(config: Any) -> tuple[int, int]:
    """(tensor-parallel ranks per stage, pipeline stages) of an EngineConfig; tp * pp ranks in all."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    for name, n in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name} must be a positive integer, not {n!r}")
    return tp, pp


def local_config(cfg: ModelConfig, tp: int, pp: int) -> ModelConfig:
    """Rank 0's config (validates that the model splits that way): its heads and MLP rows, of stage 0's
    layers; stage 0 has the most layers, so it sizes every rank's KV pool."""
    shard = ShardPlan(cfg, 0, tp).local_config()
    return StagePlan(cfg, 0, pp).local_config(shard) if pp > 1 else shard


def start_rank0(config: Any, folder: Path, cfg: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype,
                max_model_len: int, num_blocks: int, attention_backend: str) -> tuple[ParallelGroup, Decoder]:
    """Spawn ranks 1..N-1 on this machine (or meet them: torchrun-style launch), share the spec, build
    rank 0's part and wait until every rank has loaded its own."""
    tp, pp = parallel_layout(config)
    world = tp * pp
    local_config(cfg, tp, pp)  # the model must split before anything starts
    mode = f"TP={tp} x PP={pp}"
    launch = external_launch()
    if launch is not None:
        if launch["rank"] != 0 or launch["world"] != world:
            raise ValueError(f"launched as rank {launch['rank']} of WORLD_SIZE={launch['world']}, but this engine is "
                             f"rank 0 of {world} ({mode})")
        init_method, procs, threads = launch["init_method"], [], config.num_threads
    else:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        procs = spawn_workers(world, init_method, config.distributed_timeout_s, tp)
        threads = threads_per_rank(world, config.num_threads)
    if threads:
        torch.set_num_threads(threads)
    group = None
    try:
        group = ParallelGroup.join(0, world, init_method, config.distributed_timeout_s, tp, processes=procs)
        spec = WorkerSpec(config, str(folder), dtype, kv_dtype, max_model_len, num_blocks, attention_backend,
                          threads, tp, pp)
        group.broadcast_object(spec)
        model = build_rank_model(spec, cfg, 0, group)
        group.rank_weight_bytes = group.gather_int(decoder_weight_bytes(model))  # every rank has loaded its shard
    except BaseException:
        if group is not None:
            group.closed = True
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        for p in procs:
            p.terminate()
        raise
    logger.info("%s: %d ranks over %s, weights per rank (MB): %s", mode, world, init_method,
                ", ".join(f"{b / 1e6:.1f}" for b in group.rank_weight_bytes))
    return group, model


class RankProcess:
    """A local worker rank: a child interpreter running hasten.distributed.rank_main."""

    def __init__(self, rank: int, world: int, init_method: str, timeout_s: float, tp_size: int):
        self.rank = rank
        self.popen = subprocess.Popen([sys.executable, "-m", "hasten.distributed.rank_main", str(rank), str(world),
                                       init_method, str(timeout_s), str(tp_size)])

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            self.popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self.popen.kill()


def spawn_workers(world: int, init_method: str, timeout_s: float, tp_size: int) -> list[RankProcess]:
    """Start ranks 1..world-1 on this machine. They end with rank 0: its "stop" message at close, or
    their next collective failing once its sockets close."""
    return [RankProcess(rank, world, init_method, timeout_s, tp_size) for rank in range(1, world)]


__all__ = ["TensorParallelError", "local_config", "parallel_layout", "start_rank0"]
