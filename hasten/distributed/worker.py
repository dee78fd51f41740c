"""Parallel execution: how rank 0 and the worker ranks build their part of the model and run each step
(tensor parallelism here; pipeline stages in hasten/distributed/pipeline.py).

The scheduler, the KV-block manager and the sampler run once, on rank 0 (hasten/engine). Each step
rank 0 broadcasts the step's tensors (`StepInputs`: token ids, positions, slot mapping, block tables)
over the control group; every rank then runs the same decoder call on its shard, meeting the others
at the all-reduces, and rank 0 samples from the gathered logits. Workers hold their part of the KV
pool (their KV heads) with the same block numbering, so rank 0's block ids are valid on every rank.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hasten.distributed.group import ParallelGroup, TensorParallelError
from hasten.distributed.layers import ParallelDecoder, ShardQuantFactory, decoder_weight_bytes
from hasten.distributed.sharding import ShardedState, ShardPlan, StagePlan
from hasten.engine.model_runner import ModelRunner, StepInputs
from hasten.model.config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """What every rank builds the same way (computed by rank 0 before it spawns or meets the others)."""

    config: Any  # EngineConfig
    folder: str
    dtype: torch.dtype
    kv_dtype: torch.dtype
    max_model_len: int
    num_blocks: int
    attention_backend: str
    threads: int | None  # intra-op threads of each worker (None: torch's default)
    tp: int = 1  # tensor-parallel ranks per stage
    pp: int = 1  # pipeline stages (global rank = stage * tp + tp rank)


def build_rank_model(spec: WorkerSpec, cfg: ModelConfig, rank: int, group: ParallelGroup) -> ParallelDecoder:
    """Rank `rank`'s decoder: its tensor-parallel shards of its pipeline stage's layers, read from the
    checkpoint part by part."""
    config = spec.config
    stage_index, tp_rank = divmod(rank, spec.tp)
    plan = ShardPlan(cfg, tp_rank, spec.tp)
    stage = StagePlan(cfg, stage_index, spec.pp) if spec.pp > 1 else None
    state = ShardedState(Path(spec.folder), plan, stage)
    if config.quantization and spec.tp > 1:
        factory = ShardQuantFactory(config, state, spec.tp)
    else:
        from hasten.quant.factory import engine_linear_factory

        factory = engine_linear_factory(config, Path(spec.folder), spec.dtype)
    model = ParallelDecoder(plan, state, group, spec.dtype, spec.max_model_len, factory, stage,
                            fused_ops=config.fused_decoder_ops, attention_group=config.attention_prefix_group)
    model.apply_cpu_switches(config)
    return model


class ParallelModelRunner(ModelRunner):
    """Rank 0's runner: each step's inputs go to the other ranks before the decoder runs here."""

    def __init__(self, model: ParallelDecoder, group: ParallelGroup, *args: Any, **kwargs: Any):
        super().__init__(model, *args, **kwargs)
        self.group = group

    def run_step(self, step: StepInputs) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        if self.group.closed or self.group.broken:
            raise TensorParallelError("the tensor-parallel group is closed (an earlier step failed)")
        try:
            self.group.broadcast_object(("step", step))
            return super().run_step(step)
        except BaseException:
            self.group.broken = True  # the other ranks may be inside this step's collectives: out of step
            raise


def worker_main(rank: int, world: int, init_method: str, timeout_s: float, tp_size: int = 0) -> None:
    """A worker rank: join the group, take the spec rank 0 broadcasts, build its shard, then run every
    step rank 0 sends until "stop". Spawned by rank 0 on one node, or `hasten serve` on a rank > 0."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s")
    group = ParallelGroup.join(rank, world, init_method, timeout_s, tp_size)
    try:
        spec: WorkerSpec = group.broadcast_object()
        if spec.threads:
            torch.set_num_threads(spec.threads)
        from hasten.model.loader import load_hf_config

        cfg = ModelConfig.from_hf(load_hf_config(Path(spec.folder)))
        model = build_rank_model(spec, cfg, rank, group)
        runner = ModelRunner(model, model.cfg, spec.num_blocks, spec.config.block_size, spec.kv_dtype,
                             spec.attention_backend, huge_pages=spec.config.wants_huge_pages())
        if spec.config.wants_huge_pages():
            from hasten.runtime.huge_pages import collapse_engine_memory

            collapse_engine_memory(model, runner)
        stage = None
        if spec.pp > 1:
            from hasten.distributed.pipeline import PipelineStage

            stage = PipelineStage(model, runner, group)
        group.gather_int(decoder_weight_bytes(model))  # loaded: rank 0 waits for every rank here
        with torch.inference_mode():
            while True:
                msg = group.broadcast_object()
                if msg[0] == "stop":
                    break
                if msg[0] == "pipeline":
                    stage.run(msg[1])
                else:
                    runner.run_step(msg[1])
    except TensorParallelError as exc:
        logger.error("leaving: %s", exc)
        os._exit(1)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
