"""Decode steps replayed from CUDA graphs at bucketed batch sizes.

A decode step (every sequence one new token, every row sampled, no prompt logprobs) of n
sequences runs in the graph of the smallest bucket B >= n. Its inputs are one flat int64
buffer per bucket, laid out by `StepLayout`; the host packs the step into that layout, padded
to B rows, and the one host-to-device copy of the step lands in the graph's own buffer. Padded
rows are inert: token 0 at position 0, written to the scratch slot (a KV block no request owns),
context length 0 (the attention kernel gives them zeros), and only the first n logits rows are
returned. Block tables are as wide as max_model_len allows, so one graph serves any context.

Without a GPU (capture=False) the same buffers and padding run eagerly: that is how the
bucketing is tested on the CPU. Graphs are captured at start-up, largest bucket first, in one
shared memory pool, after a warm-up run that compiles the kernels.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hasten.model.layers import AttentionMetadata


def graph_buckets(max_batch: int, max_num_seqs: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, 8, then every multiple of 8 up to min(max_batch, max_num_seqs)."""
    limit = max(1, min(max_batch, max_num_seqs))
    sizes = {b for b in (1, 2, 4) if b <= limit} | set(range(8, limit + 1, 8)) | {limit}
    return sorted(sizes)


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding n rows (None: n is beyond the largest)."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


@dataclass(frozen=True)
class StepLayout:
    """Offsets of a step's tensors in one flat int64 buffer: ids, positions, slots [rows] each,
    query_start [seqs + 1], context_lens [seqs], block_tables [seqs, width], sample_rows [samples]."""

    rows: int
    seqs: int
    width: int
    samples: int

    @property
    def size(self) -> int:
        return 3 * self.rows + 2 * self.seqs + 1 + self.seqs * self.width + self.samples

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        r, s, w = self.rows, self.seqs, self.width
        out, at = {}, 0
        for name, n in (("input_ids", r), ("positions", r), ("slot_mapping", r), ("query_start", s + 1),
                        ("context_lens", s), ("block_tables", s * w), ("sample_rows", self.samples)):
            out[name] = flat[at : at + n]
            at += n
        out["block_tables"] = out["block_tables"].view(s, w)
        return out


def pack_step(layout: StepLayout, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              query_start: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
              sample_rows: torch.Tensor | None, scratch_slot: int, out: torch.Tensor) -> torch.Tensor:
    """Write a step into `out[:layout.size]` (host memory), padded to the layout's rows and sequences:
    the padding rows are one-token sequences of context 0 writing to `scratch_slot`."""
    flat = out[: layout.size]
    v = layout.views(flat)
    n, s = input_ids.numel(), context_lens.numel()
    v["input_ids"][:n] = input_ids
    v["input_ids"][n:] = 0
    v["positions"][:n] = positions
    v["positions"][n:] = 0
    v["slot_mapping"][:n] = slots
    v["slot_mapping"][n:] = scratch_slot
    qs = v["query_start"]
    qs[: s + 1] = query_start
    if layout.seqs > s:  # each padding sequence owns one padding row
        qs[s + 1 :] = torch.arange(n + 1, n + 1 + layout.seqs - s)
    v["context_lens"][:s] = context_lens
    v["context_lens"][s:] = 0
    tables = v["block_tables"]
    tables.zero_()
    tables[:s, : block_tables.shape[1]] = block_tables
    if layout.samples:
        assert sample_rows is not None
        v["sample_rows"][:] = sample_rows
    return flat


@dataclass
class DecodeGraph:
    """One bucket's input buffer (on the device), its metadata views, and its captured graph."""

    batch: int
    layout: StepLayout
    flat: torch.Tensor
    meta: AttentionMetadata
    views: dict[str, torch.Tensor]
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # the graph's output [batch, V]


StepFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class DecodeGraphs:
    """The buckets' buffers and graphs; `step_fn(input_ids, positions, meta) -> logits [rows, V]`."""

    def __init__(self, step_fn: StepFn, buckets: list[int], width: int, device: torch.device,
                 decode_splits: Callable[[int, int], int], capture: bool):
        self.step_fn = step_fn
        self.buckets = buckets
        self.width = width
        self.device = device
        self.capture = capture
        self.graphs: dict[int, DecodeGraph] = {}
        for b in buckets:
            layout = StepLayout(rows=b, seqs=b, width=width, samples=0)
            flat = torch.zeros(layout.size, dtype=torch.long, device=device)
            views = layout.views(flat)
            meta = AttentionMetadata(slot_mapping=views["slot_mapping"], block_tables=views["block_tables"],
                                     query_start=views["query_start"], context_lens=views["context_lens"],
                                     kernel="triton", max_query_len=1, decode_splits=decode_splits(width, b))
            self.graphs[b] = DecodeGraph(b, layout, flat, meta, views)
        self.captured = False

    def bucket(self, num_seqs: int) -> int | None:
        return bucket_for(num_seqs, self.buckets)

    def layout(self, batch: int) -> StepLayout:
        return self.graphs[batch].layout

    def _run(self, g: DecodeGraph) -> torch.Tensor:
        return self.step_fn(g.views["input_ids"], g.views["positions"], g.meta)

    def capture_all(self) -> None:
        """Warm up and capture every bucket (largest first, one memory pool); no-op without capture."""
        if not self.capture or self.captured:
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for b in sorted(self.buckets, reverse=True):
                g = self.graphs[b]
                self._reset_padding(g)
                self._run(g)  # compiles the kernels for this shape outside the capture
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        for b in sorted(self.buckets, reverse=True):
            g = self.graphs[b]
            g.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g.graph, pool=pool):
                g.logits = self._run(g)
        torch.cuda.synchronize(self.device)
        self.captured = True

    def _reset_padding(self, g: DecodeGraph) -> None:
        """All rows padding (the warm-up's input): what an empty step would hold."""
        v = g.views
        for name in ("input_ids", "positions", "context_lens"):
            v[name].zero_()
        v["query_start"].copy_(torch.arange(g.batch + 1, device=self.device))
        v["block_tables"].zero_()

    def fill(self, batch: int, host_flat: torch.Tensor) -> None:
        """The step's one host-to-device copy, into the bucket's own buffer."""
        self.graphs[batch].flat.copy_(host_flat, non_blocking=True)

    def replay(self, batch: int, rows: int) -> torch.Tensor:
        """Logits [rows, V] of the step just filled into bucket `batch`."""
        g = self.graphs[batch]
        if g.graph is not None:
            g.graph.replay()
            assert g.logits is not None
            return g.logits[:rows]
        return self._run(g)[:rows]
