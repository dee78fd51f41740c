"""The model runner of the device path: the step's tensors built on the host, moved in one copy.

The scheduler, the KV manager and the requests stay plain Python on the host; ModelRunner.prepare
builds the step there. With the Triton backend every int64 tensor of the step (token ids,
positions, slots, query starts, context lengths, block tables, sampled rows) is packed into one
pinned host buffer (hasten/runtime/cuda_graphs.StepLayout) and copied to the device once; the
decoder then runs on device tensors only, and the sampled tokens come back in one copy
(hasten/runtime/sampler.py). A decode step that fits a CUDA-graph bucket is packed padded to the
bucket, straight into that graph's buffer, and replayed.

The pool has one block more than the KV manager hands out: the scratch block that padding rows
write their keys and values to.
"""

from __future__ import annotations

import logging
import time

import torch

from hasten.engine.model_runner import ModelRunner, PreparedStep, StepInputs
from hasten.engine.scheduler import ScheduledBatch
from hasten.model.config import ModelConfig
from hasten.model.decoder import Decoder
from hasten.model.layers import AttentionGroup, AttentionMetadata
from hasten.runtime.cuda_graphs import DecodeGraphs, StepLayout, graph_buckets, pack_step

logger = logging.getLogger(__name__)

GRAPH_MODES = ("off", "capture", "padded")  # padded: the buckets' buffers and padding, run eagerly (CPU tests)


class DeviceModelRunner(ModelRunner):
    def __init__(self, model: Decoder, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 attention_backend: str, device: torch.device, max_model_len: int, graph_mode: str = "off",
                 graph_max_batch: int = 256, max_num_seqs: int = 64):
        """num_blocks: the KV manager's blocks (the pool gets one more, the scratch block).
        graph_mode: off | capture (CUDA graphs for decode steps) | padded (the same buckets, eager)."""
        if graph_mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode must be one of {GRAPH_MODES}, got {graph_mode!r}")
        super().__init__(model, cfg, num_blocks + 1, block_size, dtype, attention_backend, device=device)
        self.device = torch.device(device)
        self.scratch_slot = num_blocks * block_size
        self.graph_width = -(-max_model_len // block_size)
        self._staging: torch.Tensor | None = None
        self.graphs: DecodeGraphs | None = None
        if graph_mode != "off" and attention_backend == "triton":
            from hasten.kernels.triton.attention import decode_splits

            kv_heads = cfg.num_kv_heads
            self.graphs = DecodeGraphs(self._decode_logits, graph_buckets(graph_max_batch, max_num_seqs),
                                       self.graph_width, self.device, lambda w, b: decode_splits(w, b, kv_heads),
                                       capture=graph_mode == "capture")

    def capture_graphs(self) -> None:
        """Capture the decode graphs (CUDA; a no-op otherwise), logging how long it took."""
        if self.graphs is None or not self.graphs.capture:
            return
        t0 = time.time()
        self.graphs.capture_all()
        logger.info("captured %d CUDA graphs (decode batches %s) in %.2fs", len(self.graphs.buckets),
                    self.graphs.buckets, time.time() - t0)

    def _decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model.logits(self.model.forward(input_ids, positions, meta, self.kv_caches))

    def _staging_buffer(self, size: int) -> torch.Tensor:
        """The host buffer steps are packed into (pinned for a GPU). Reused: the previous step's copy
        is done by the time the next step is packed (its sampled tokens were read back)."""
        if self._staging is None or self._staging.numel() < size:
            pin = self.device.type == "cuda"
            self._staging = torch.empty(max(size, 4096), dtype=torch.long, pin_memory=pin)
        return self._staging

    def graph_bucket(self, step: StepInputs, num_seqs: int) -> int | None:
        """The bucket a step replays in: a pure decode step (one new token per sequence, each sampled,
        no prompt logprobs) of at most the largest bucket's sequences; else None (eager)."""
        meta = step.meta
        if (self.graphs is None or meta.max_query_len != 1 or step.prompt_spans or step.sample_rows is None
                or step.sample_rows.numel() != num_seqs or step.input_ids.numel() != num_seqs):
            return None
        return self.graphs.bucket(num_seqs)

    def prepare(self, batch: ScheduledBatch) -> PreparedStep:
        prepared = super().prepare(batch)
        if self.attention_backend == "triton":
            prepared.step = self.upload(prepared.step)
        else:
            prepared.step = self._move_padded(prepared.step)
        return prepared

    def upload(self, step: StepInputs) -> StepInputs:
        """The step on the device after one host-to-device copy (into a graph's buffer when it has one)."""
        meta = step.meta
        assert meta.block_tables is not None and meta.query_start is not None and meta.context_lens is not None
        seqs = meta.context_lens.numel()
        bucket = self.graph_bucket(step, seqs)
        if bucket is not None:
            assert self.graphs is not None
            layout = self.graphs.layout(bucket)
            flat = pack_step(layout, step.input_ids, step.positions, meta.slot_mapping, meta.query_start,
                             meta.context_lens, meta.block_tables, None, self.scratch_slot,
                             self._staging_buffer(layout.size))
            self.graphs.fill(bucket, flat)
            g = self.graphs.graphs[bucket]
            return StepInputs(g.views["input_ids"], g.views["positions"], g.meta, None, [], graph=(bucket, seqs))
        samples = step.sample_rows.numel() if step.sample_rows is not None else 0
        layout = StepLayout(rows=step.input_ids.numel(), seqs=seqs, width=meta.block_tables.shape[1], samples=samples)
        flat = pack_step(layout, step.input_ids, step.positions, meta.slot_mapping, meta.query_start,
                         meta.context_lens, meta.block_tables, step.sample_rows, self.scratch_slot,
                         self._staging_buffer(layout.size))
        v = layout.views(flat.to(self.device, non_blocking=True))
        dmeta = AttentionMetadata(slot_mapping=v["slot_mapping"], block_tables=v["block_tables"],
                                  query_start=v["query_start"], context_lens=v["context_lens"], kernel="triton",
                                  max_query_len=meta.max_query_len)
        return StepInputs(v["input_ids"], v["positions"], dmeta, v["sample_rows"] if samples else None,
                          step.prompt_spans)

    def _move_padded(self, step: StepInputs) -> StepInputs:
        """The sdpa backend's padded groups moved tensor by tensor (a comparison path, not the fast one)."""
        dev = self.device

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return t.to(dev, non_blocking=True) if t is not None else None

        groups = [AttentionGroup(move(g.token_index), move(g.block_tables), move(g.mask), move(g.flat_valid_index),
                                 move(g.flat_token_index)) for g in step.meta.groups]
        meta = AttentionMetadata(slot_mapping=move(step.meta.slot_mapping), groups=groups)
        return StepInputs(move(step.input_ids), move(step.positions), meta, move(step.sample_rows), step.prompt_spans)

    def run_step(self, step: StepInputs) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        if step.graph is not None:
            assert self.graphs is not None
            bucket, rows = step.graph
            return self.graphs.replay(bucket, rows), []
        return super().run_step(step)
