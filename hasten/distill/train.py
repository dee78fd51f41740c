"""Distillation: a student trained on its teacher's next-token distributions (KL on the logits),
optionally mixed with cross-entropy on the text's own next tokens (`ce_weight`).

The loop is plain PyTorch on transformers models. Every step takes the next `batch_size` training
sequences in a fixed, seeded order, runs the frozen teacher and the student on them, and minimises
KL(teacher || student) per token with AdamW and gradient clipping. Every `eval_every` steps it
measures the same KL on held-out sequences. Deterministic for a given seed and thread count; a
checkpoint (student, optimizer, step, RNG) is written every `checkpoint_every` steps and at the end
of the time budget, and a run with the same settings resumes from it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hasten.distill.common import CHECKPOINT

logger = logging.getLogger(__name__)


PRECISIONS = ("float32", "bfloat16", "auto")


@dataclass(frozen=True)
class DistillConfig:
    steps: int = 200
    batch_size: int = 2
    lr: float = 5e-5
    weight_decay: float = 0.0
    warmup_steps: int = 10
    max_grad_norm: float = 1.0
    temperature: float = 1.0
    eval_every: int = 50
    checkpoint_every: int = 50
    seed: int = 0
    max_minutes: float | None = None  # stop (with a checkpoint) once this run has trained this long
    # the student's and teacher's forward passes: float32 | bfloat16 (CPU autocast: bfloat16 GEMMs, float32
    # weights, optimizer state and softmax) | auto (bfloat16 where the CPU has its dot product, else float32)
    precision: str = "float32"
    train_embeddings: bool = True  # False: the token embedding and lm_head (often one tied matrix) stay fixed
    # share of the loss taken by cross-entropy on the text's own next tokens (Hinton et al.'s hard labels):
    # loss = (1 - ce_weight) * KL(teacher || student) + ce_weight * CE(text); 0 is pure distillation
    ce_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.steps < 0 or self.batch_size < 1 or self.eval_every < 1 or self.checkpoint_every < 1:
            raise ValueError("steps >= 0, batch_size, eval_every and checkpoint_every >= 1")
        if not (self.lr > 0 and self.temperature > 0):
            raise ValueError("lr and temperature must be positive")
        if not 0.0 <= self.ce_weight <= 1.0:
            raise ValueError(f"ce_weight is a share of the loss: 0 <= ce_weight <= 1, not {self.ce_weight}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, not {self.precision!r}")

    def autocast_dtype(self) -> torch.dtype | None:
        """bfloat16 when the forward passes run under CPU autocast, None for plain float32."""
        if self.precision == "auto":
            from hasten.kernels.cpu_features import cpu_has_bf16_dot

            return torch.bfloat16 if cpu_has_bf16_dot() else None
        return torch.bfloat16 if self.precision == "bfloat16" else None


@dataclass
class DistillState:
    step: int = 0
    train_seconds: float = 0.0
    history: list[dict[str, float]] = field(default_factory=list)  # {step, loss} and {step, heldout_kl}


class _TeacherKL(torch.autograd.Function):
    """Sum over rows of KL(softmax(t / T) || softmax(s / T)) with its gradient, (softmax(s / T) - p) / T,
    computed in the same pass over `chunk` rows at a time: no log-softmax graph over the whole
    [tokens, vocabulary] logits is kept for the backward pass, only the gradient itself."""

    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor, temperature: float, chunk: int) -> torch.Tensor:
        s, t = student.detach().flatten(0, -2), teacher.detach().flatten(0, -2)
        grad = torch.empty_like(s) if ctx.needs_input_grad[0] else None
        total = torch.zeros((), dtype=torch.float64)
        for i in range(0, s.shape[0], chunk):
            log_q = F.log_softmax(s[i : i + chunk].float() / temperature, dim=-1)
            log_p = F.log_softmax(t[i : i + chunk].float() / temperature, dim=-1)
            p = log_p.exp()
            total += (p * (log_p - log_q)).sum(dtype=torch.float64)
            if grad is not None:
                grad[i : i + chunk] = (log_q.exp_() - p) / temperature
        ctx.save_for_backward(grad if grad is not None else torch.empty(0))
        ctx.shape = student.shape
        return total.float()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return (grad * grad_output.to(grad.dtype)).view(ctx.shape), None, None, None


def kl_per_token(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
                 chunk: int = 128) -> torch.Tensor:
    """Mean over tokens of KL(softmax(teacher / T) || softmax(student / T)), times T^2 (Hinton's scale).
    Differentiable in the student's logits (float32 softmax whatever their dtype)."""
    rows = student_logits.numel() // student_logits.shape[-1]
    total = _TeacherKL.apply(student_logits, teacher_logits, float(temperature), chunk)
    return total * (temperature * temperature / max(rows, 1))


def autocast(dtype: torch.dtype | None):
    """CPU autocast to `dtype` (None: off)."""
    return torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)


@torch.no_grad()
def heldout_kl(student: Any, teacher: Any, sequences: Sequence[Sequence[int]], temperature: float = 1.0,
               dtype: torch.dtype | None = None) -> float:
    """Mean per-token KL of the student from the teacher over `sequences` (forward passes under
    autocast to `dtype` when given)."""
    was_training = student.training
    student.eval()
    total, tokens = 0.0, 0
    for ids in sequences:
        x = torch.tensor([list(ids)])
        with autocast(dtype):
            s, t = student(x, use_cache=False).logits, teacher(x, use_cache=False).logits
        kl = kl_per_token(s, t, temperature)
        total += float(kl) * len(ids)
        tokens += len(ids)
    student.train(was_training)
    return total / max(tokens, 1)


class TrainLoop:
    """The loop every distillation shares: AdamW with warm-up and cosine decay, a seeded order of the
    training items, a held-out measure every `eval_every` steps, checkpoints and exact resume.
    Subclasses give `_step(batch)` (one optimizer step, returns the loss) and `evaluate()`."""

    metric = "heldout"  # the history key of evaluate()'s figure

    def __init__(self, model: Any, items: Sequence[Any], config: DistillConfig, checkpoint_dir: Path | None = None,
                 signature: dict | None = None):
        if not items:
            raise ValueError("no training sequences")
        self.model, self.config, self.items = model, config, items
        self.checkpoint_dir = checkpoint_dir
        self.signature = signature or {}  # what a checkpoint must match to be resumed
        torch.manual_seed(config.seed)
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.state = DistillState()
        self.order = self._order()

    def _lr_factor(self, step: int) -> float:
        """Linear warm-up, then cosine decay to 10 % at the last step."""
        c = self.config
        if step < c.warmup_steps:
            return (step + 1) / c.warmup_steps
        span = max(1, c.steps - c.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - c.warmup_steps) / span)))

    def _order(self) -> list[int]:
        """The training item of every step: seeded shuffles of the data, concatenated."""
        c = self.config
        g = torch.Generator().manual_seed(c.seed)
        need = max(1, c.steps * c.batch_size)
        order: list[int] = []
        while len(order) < need:
            order += torch.randperm(len(self.items), generator=g).tolist()
        return order[:need]

    # ------------------------------------------------------------ checkpoints
    def _checkpoint_path(self) -> Path | None:
        return self.checkpoint_dir / CHECKPOINT if self.checkpoint_dir is not None else None

    def save_checkpoint(self) -> None:
        path = self._checkpoint_path()
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"student": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "schedule": self.schedule.state_dict(), "state": asdict(self.state),
                    "rng": torch.get_rng_state(), "signature": self.signature,
                    "config": asdict(self.config)}, tmp)
        tmp.replace(path)

    def try_resume(self) -> bool:
        """Load the checkpoint of a run with the same signature and settings; False when there is none."""
        path = self._checkpoint_path()
        if path is None or not path.exists():
            return False
        ck = torch.load(path, map_location="cpu", weights_only=False)
        mine = {k: v for k, v in asdict(self.config).items() if k != "max_minutes"}
        theirs = {k: v for k, v in ck["config"].items() if k != "max_minutes"}
        if ck["signature"] != self.signature or theirs != mine:
            raise ValueError(f"{path} is the checkpoint of a different run (other model, layers or settings): "
                             "pass --restart to discard it, or another --out")
        self.model.load_state_dict(ck["student"])
        self.optimizer.load_state_dict(ck["optimizer"])
        self.schedule.load_state_dict(ck["schedule"])
        self.state = DistillState(**ck["state"])
        torch.set_rng_state(ck["rng"])
        logger.info("resumed at step %d of %d", self.state.step, self.config.steps)
        return True

    # ------------------------------------------------------------ the loop
    def evaluate(self) -> float:
        raise NotImplementedError

    def _step(self, batch: list[Any]) -> float:
        raise NotImplementedError

    def run(self, progress: Callable[[DistillState, dict[str, float]], None] | None = None) -> DistillState:
        """Train until `steps` or the time budget; returns the state (step reached, history)."""
        c, st = self.config, self.state
        if not st.history:
            st.history.append({"step": 0, self.metric: self.evaluate()})
        self.model.train()
        run_start, trained_before = time.monotonic(), st.train_seconds  # the budget is this run's
        while st.step < c.steps:
            if c.max_minutes is not None and time.monotonic() - run_start > 60 * c.max_minutes:
                logger.info("time budget of %.1f min reached at step %d", c.max_minutes, st.step)
                break
            batch = [self.items[i] for i in self.order[st.step * c.batch_size : (st.step + 1) * c.batch_size]]
            loss = self._step(batch)
            st.step += 1
            st.train_seconds = trained_before + time.monotonic() - run_start
            record = {"step": st.step, "loss": loss}
            if st.step % c.eval_every == 0 or st.step == c.steps:
                record[self.metric] = self.evaluate()
            st.history.append(record)
            if progress is not None:
                progress(st, record)
            if st.step % c.checkpoint_every == 0:
                self.save_checkpoint()
        if self.metric not in st.history[-1]:
            st.history.append({"step": st.step, self.metric: self.evaluate()})
        self.save_checkpoint()
        self.model.eval()
        return st


class Distiller(TrainLoop):
    """Trains `student` toward `teacher` on `train` sequences; `heldout` measures it."""

    metric = "heldout_kl"

    def __init__(self, student: Any, teacher: Any, train: Sequence[Sequence[int]], heldout: Sequence[Sequence[int]],
                 config: DistillConfig, checkpoint_dir: Path | None = None, signature: dict | None = None):
        self.student, self.teacher = student, teacher
        self.heldout = [list(s) for s in heldout]
        teacher.eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        if not config.train_embeddings:
            for emb in (student.get_input_embeddings(), student.get_output_embeddings()):
                if emb is not None:
                    emb.weight.requires_grad_(False)
        self.dtype = config.autocast_dtype()
        super().__init__(student, [list(s) for s in train], config, checkpoint_dir, signature)

    def evaluate(self) -> float:
        return heldout_kl(self.student, self.teacher, self.heldout, self.config.temperature, self.dtype)

    def _step(self, batch: list[list[int]]) -> float:
        """One optimizer step over `batch` (sequences of any lengths, one forward each)."""
        c = self.config
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = sum(len(s) for s in batch)
        loss_sum = 0.0
        for ids in batch:
            x = torch.tensor([ids])
            with autocast(self.dtype):
                with torch.no_grad():
                    target = self.teacher(x, use_cache=False).logits
                logits = self.student(x, use_cache=False).logits
            loss = kl_per_token(logits, target, c.temperature)
            if c.ce_weight > 0 and len(ids) > 1:
                ce = F.cross_entropy(logits[0, :-1].float(), x[0, 1:])
                loss = (1.0 - c.ce_weight) * loss + c.ce_weight * ce
            (loss * (len(ids) / total_tokens)).backward()
            loss_sum += loss.item() * len(ids)
        torch.nn.utils.clip_grad_norm_(self.student.parameters(), c.max_grad_norm)  # fixed ones have no grad
        self.optimizer.step()
        self.schedule.step()
        return loss_sum / total_tokens


def write_report(path: Path, report: dict) -> None:
    path.write_text(json.dumps(report, indent=2) + "\n")
