"""Pipeline parallelism: the decoder's layers split into stages, micro-batches in flight.

Stage s (hasten/distributed/sharding.py's StagePlan) holds layers [lo, hi), their part of the KV pool,
the embedding (stage 0) and the final norm + lm_head (the last stage); with tensor parallelism too,
a stage is a group of TP ranks (global rank = stage * tp + tp_rank). Rank 0 is
stage 0 and runs the scheduler: each step it splits the batch's sequences into up to `stages`
micro-batches, broadcasts their inputs, and every stage runs them in order: receive the residual
stream of micro-batch m from the stage before, run its layers, send it on (asynchronously, so stage
s works on m + 1 while stage s + 1 takes m). The last stage sends the logits rows back to rank 0,
which samples. Over a network that is one hidden-state transfer per stage boundary instead of TP's
two all-reduces per layer.
"""

from __future__ import annotations

from typing import Any

import torch

from hasten.distributed.group import ParallelGroup, TensorParallelError
from hasten.distributed.layers import ParallelDecoder
from hasten.engine.model_runner import ModelRunner, StepInputs, StepResult
from hasten.engine.scheduler import ScheduledBatch


class PipelineStage:
    """What every rank runs for one step: its layers over each micro-batch, in order."""

    def __init__(self, model: ParallelDecoder, runner: ModelRunner, group: ParallelGroup):
        self.model = model
        self.runner = runner
        self.group = group

    def run(self, steps: list[StepInputs]) -> list[tuple[torch.Tensor | None, list[torch.Tensor]]]:
        """Rank 0 gets each micro-batch's (sampled logits, prompt-span logits); the other ranks [].

        With tensor parallelism inside the stages each TP rank passes its (identical) residual stream to
        the same TP rank of the next stage, and the last stage's TP rank 0 sends the logits."""
        model, group = self.model, self.group
        stage, last = model.stage.stage, model.stage.stages - 1
        tp, t = group.tp_size, group.tp_rank
        hidden = model.cfg.hidden_size
        pending = []
        for m, st in enumerate(steps):
            if stage > 0:
                model.hidden_in = torch.empty(st.input_ids.shape[0], hidden, dtype=model.dtype)
                group.recv(model.hidden_in, (stage - 1) * tp + t, m)
            out = model.forward(st.input_ids, st.positions, st.meta, self.runner.kv_caches)
            model.hidden_in = None
            if stage < last:
                pending.append(group.isend(out.contiguous(), (stage + 1) * tp + t, m))
                continue
            rows = _logit_rows(st)
            if rows is not None:
                logits = model.logits(out[rows])  # gathered over the stage's TP ranks
                if t == 0:
                    pending.append(group.isend(logits.contiguous(), 0, m))
        for work in pending:
            group.wait(work)
        if group.rank != 0:
            return []
        results = []
        vocab = model.plan.cfg.vocab_size
        for m, st in enumerate(steps):
            rows = _logit_rows(st)
            if rows is None:
                results.append((None, []))
                continue
            logits = torch.empty(rows.shape[0], vocab)
            group.recv(logits, last * tp, m)
            n = st.sample_rows.shape[0] if st.sample_rows is not None else 0
            spans, start = [], n
            for _, count in st.prompt_spans:
                spans.append(logits[start : start + count])
                start += count
            results.append((logits[:n] if st.sample_rows is not None else None, spans))
        return results


def _logit_rows(step: StepInputs) -> torch.Tensor | None:
    """The hidden rows whose logits go back to rank 0: the sampled rows, then each prompt span's."""
    parts = [step.sample_rows] if step.sample_rows is not None else []
    parts += [torch.arange(first, first + count) for first, count in step.prompt_spans]
    return torch.cat(parts) if parts else None


def split_batch(batch: ScheduledBatch, parts: int) -> list[ScheduledBatch]:
    """Up to `parts` micro-batches of consecutive sequences with about equal token counts."""
    n = len(batch.requests)
    parts = max(1, min(parts, n))
    target = batch.total_tokens / parts
    out: list[ScheduledBatch] = []
    cur = ScheduledBatch()
    done = 0
    for i, (req, k) in enumerate(zip(batch.requests, batch.num_new_tokens, strict=True)):
        cur.requests.append(req)
        cur.num_new_tokens.append(k)
        done += k
        left_parts = parts - len(out) - 1
        if left_parts > 0 and (done >= target * (len(out) + 1) or n - i - 1 == left_parts):
            out.append(cur)
            cur = ScheduledBatch()
    if cur.requests:
        out.append(cur)
    return out


class PipelineModelRunner(ModelRunner):
    """Rank 0's runner: the batch in micro-batches through every stage."""

    def __init__(self, model: ParallelDecoder, group: ParallelGroup, *args: Any, **kwargs: Any):
        super().__init__(model, *args, **kwargs)
        self.group = group
        self.stage = PipelineStage(model, self, group)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        if self.group.closed or self.group.broken:
            raise TensorParallelError("the pipeline-parallel group is closed (an earlier step failed)")
        prepared = [self.prepare(b) for b in split_batch(batch, self.model.stage.stages)]
        steps = [p.step for p in prepared]
        try:
            self.group.broadcast_object(("pipeline", steps))
            outs = self.stage.run(steps)
        except BaseException:
            self.group.broken = True  # the other ranks may be inside this step: out of step for good
            raise
        results = [p.result(*out) for p, out in zip(prepared, outs, strict=True)]
        logits = [r.logits for r in results if r.logits is not None]
        return StepResult([q for r in results for q in r.sample_requests], torch.cat(logits) if logits else None,
                          [k for r in results for k in r.num_rows],
                          {k: v for r in results for k, v in r.prompt_logits.items()})
