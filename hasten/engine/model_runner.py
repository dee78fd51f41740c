"""Turns a scheduled batch into tensors, runs the decoder, returns the logits that are needed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hasten.engine.request import Request
from hasten.engine.scheduler import ScheduledBatch
from hasten.model.config import ModelConfig
from hasten.model.decoder import Decoder
from hasten.model.dtypes import kv_bytes_per_token, kv_row_width
from hasten.model.layers import AttentionGroup, AttentionMetadata


@dataclass
class StepResult:
    # requests whose newest real token is now computed: each gets 1 + (scheduled draft tokens) rows
    sample_requests: list[Request]
    logits: torch.Tensor  # [sum of rows, V] float32, in sample_requests order
    num_rows: list[int]
    # request -> (first position covered, logits rows [n, V]) for prompt logprobs
    prompt_logits: dict[str, tuple[int, torch.Tensor]]


@dataclass
class StepInputs:
    """Everything the decoder needs for one step: what rank 0 sends its tensor-parallel peers."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor | None  # rows whose logits are sampled
    prompt_spans: list[tuple[int, int]]  # (first row, count) of each prompt-logprobs request, in order
    graph: tuple[int, int] | None = None  # (bucket, rows): a decode step replayed from a CUDA graph (hasten/runtime)


@dataclass
class PreparedStep:
    step: StepInputs
    sample_requests: list[Request]
    num_rows: list[int]
    prompt_requests: list[tuple[Request, int]]  # (request, first position) of each prompt span

    def result(self, logits: torch.Tensor | None, prompt_rows: list[torch.Tensor]) -> StepResult:
        prompt_logits = {req.request_id: (first_pos, lg)
                         for (req, first_pos), lg in zip(self.prompt_requests, prompt_rows, strict=True)}
        return StepResult(self.sample_requests, logits, self.num_rows, prompt_logits)


def _pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, huge_pages: bool) -> torch.Tensor:
    """One zeroed cache pool; with huge_pages (CPU) its memory asked for in 2 MB pages before it is written."""
    if not huge_pages or torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    from hasten.runtime.huge_pages import advise

    pool = torch.empty(shape, dtype=dtype)
    advise(pool)
    return pool.zero_()


class ModelRunner:
    def __init__(
        self,
        model: Decoder,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        attention_backend: str = "sdpa",
        device: torch.device | str = "cpu",
        huge_pages: bool = False,
    ):
        """dtype: the KV cache's (the model's, or a narrower float16 / bfloat16).
        attention_backend: "cpp" (kernel reading the block pool in place), "triton" (the same flat
        layout, read by the Triton kernels) or "sdpa" (padded gather). device: where the pool lives.
        huge_pages: a CPU pool asks for 2 MB pages before its first write (EngineConfig.huge_pages)."""
        if attention_backend not in ("cpp", "sdpa", "triton"):
            raise ValueError(f"unknown attention backend {attention_backend!r}")
        self.attention_backend = attention_backend
        self.keep_hidden = False  # keep each step's final hidden states in last_hidden (an EAGLE draft reads them)
        self.last_hidden: torch.Tensor | None = None
        self.model = model
        self.cfg = cfg
        self.block_size = block_size
        shape = (num_blocks, block_size, cfg.num_kv_heads, kv_row_width(cfg.head_dim, dtype))
        self.kv_caches = [(_pool(shape, dtype, device, huge_pages), _pool(shape, dtype, device, huge_pages))
                          for _ in range(cfg.num_layers)]

    @staticmethod
    def blocks_for_memory(cfg: ModelConfig, block_size: int, dtype: torch.dtype, memory_bytes: int) -> int:
        per_block = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype) * block_size
        return max(1, memory_bytes // per_block)

    def _group(self, reqs: list[Request], starts: list[int], lens: list[int], rows: list[int]) -> AttentionGroup:
        """Pad the given sequences into one attention call. rows[i]: flat-batch row of seq i's first token."""
        bs = self.block_size
        b = len(reqs)
        lq = max(lens)
        ctx = [s + n for s, n in zip(starts, lens, strict=True)]
        nblocks = -(-max(ctx) // bs)
        tables = torch.zeros(b, nblocks, dtype=torch.long)
        for i, r in enumerate(reqs):
            ids = r.block_ids[: -(-ctx[i] // bs)]
            tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        lk = nblocks * bs
        key_pos = torch.arange(lk)
        q_off = torch.arange(lq)
        start_t = torch.tensor(starts).view(b, 1)
        len_t = torch.tensor(lens).view(b, 1)
        valid = q_off.view(1, lq) < len_t  # [B, Lq]
        query_pos = start_t + q_off.view(1, lq)  # absolute position of each query
        if lq == 1:
            mask = key_pos.view(1, 1, 1, lk) < torch.tensor(ctx).view(b, 1, 1, 1)
            if b == 1 and ctx[0] == lk:
                mask = None
        else:
            mask = key_pos.view(1, 1, 1, lk) <= query_pos.view(b, 1, lq, 1)
            # padded query slots: let them see key 0 so softmax stays finite (outputs are dropped)
            mask = mask | (~valid).view(b, 1, lq, 1) & (key_pos.view(1, 1, 1, lk) == 0)
        row_t = torch.tensor(rows).view(b, 1)
        token_index = torch.where(valid, row_t + q_off.view(1, lq), row_t)
        flat_valid = valid.view(-1).nonzero().squeeze(1)
        return AttentionGroup(
            token_index=token_index,
            block_tables=tables,
            mask=mask,
            flat_valid_index=flat_valid,
            flat_token_index=token_index.view(-1)[flat_valid],
        )

    def _flat_metadata(self, batch: ScheduledBatch, starts: list[int], slot_mapping: torch.Tensor) -> AttentionMetadata:
        bs = self.block_size
        ctx = [s + n for s, n in zip(starts, batch.num_new_tokens, strict=True)]
        width = -(-max(ctx) // bs)
        flat: list[int] = []
        for req, c in zip(batch.requests, ctx, strict=True):
            used = -(-c // bs)
            flat.extend(req.block_ids[:used])
            flat.extend([0] * (width - used))
        query_start = [0]
        for n in batch.num_new_tokens:
            query_start.append(query_start[-1] + n)
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=torch.tensor(flat, dtype=torch.int32).view(len(ctx), width),
            query_start=torch.tensor(query_start, dtype=torch.long),
            context_lens=torch.tensor(ctx, dtype=torch.long),
            kernel=self.attention_backend,
            max_query_len=max(batch.num_new_tokens),
        )

    def _padded_metadata(
        self, batch: ScheduledBatch, starts: list[int], rows: list[int], slot_mapping: torch.Tensor
    ) -> AttentionMetadata:
        decode = [i for i, n in enumerate(batch.num_new_tokens) if n == 1]
        prefill = [i for i, n in enumerate(batch.num_new_tokens) if n > 1]
        groups = []
        for sel in (decode, prefill):
            if sel:
                groups.append(
                    self._group(
                        [batch.requests[i] for i in sel],
                        [starts[i] for i in sel],
                        [batch.num_new_tokens[i] for i in sel],
                        [rows[i] for i in sel],
                    )
                )
        return AttentionMetadata(slot_mapping=slot_mapping, groups=groups)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        prepared = self.prepare(batch)
        logits, prompt_rows = self.run_step(prepared.step)
        return prepared.result(logits, prompt_rows)

    def prepare(self, batch: ScheduledBatch) -> PreparedStep:
        """The step's tensors for `batch`, and which requests its logits rows belong to."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        sample_reqs: list[Request] = []
        sample_rows: list[int] = []
        num_rows: list[int] = []
        prompt_lp: list[tuple[Request, int, int, int]] = []  # req, first pos, first row, count
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            start = req.num_computed_tokens
            rows.append(len(input_ids))
            input_ids.extend(req.tokens_with_spec(start, start + n))
            pos = range(start, start + n)
            positions.extend(pos)
            table = req.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            if req.params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                count = min(start + n, req.num_prompt_tokens - 1) - start
                prompt_lp.append((req, start, rows[-1], count))
            last_real = req.num_tokens - 1  # position whose logits give the next real token
            if start <= last_real < start + n:
                first = rows[-1] + last_real - start
                k = start + n - 1 - last_real  # draft tokens scheduled after it
                sample_reqs.append(req)
                sample_rows.extend(range(first, first + k + 1))
                num_rows.append(k + 1)

        starts = [r.num_computed_tokens for r in batch.requests]
        slot_mapping = torch.tensor(slots, dtype=torch.long)
        if self.attention_backend in ("cpp", "triton"):
            meta = self._flat_metadata(batch, starts, slot_mapping)
        else:
            meta = self._padded_metadata(batch, starts, rows, slot_mapping)
        step = StepInputs(torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta,
                          torch.tensor(sample_rows, dtype=torch.long) if sample_reqs else None,
                          [(first_row, count) for _, _, first_row, count in prompt_lp])
        return PreparedStep(step, sample_reqs, num_rows, [(req, first_pos) for req, first_pos, _, _ in prompt_lp])

    def run_step(self, step: StepInputs) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """The decoder over one step's tensors: (logits of the sampled rows, logits of each prompt-logprobs span).
        A tensor-parallel runner first hands `step` to its other ranks, which run this same function."""
        # only the sampled rows' hidden states are read (the decoder may then skip the others' last layer)
        rows = step.sample_rows if not (step.prompt_spans or self.keep_hidden) else None
        hidden = self.model.forward(step.input_ids, step.positions, step.meta, self.kv_caches, out_rows=rows)
        if self.keep_hidden:
            self.last_hidden = hidden
        if rows is not None:
            return self.model.logits(hidden), []
        logits = self.model.logits(hidden[step.sample_rows]) if step.sample_rows is not None else None
        return logits, [self.model.logits(hidden[first : first + count]) for first, count in step.prompt_spans]
