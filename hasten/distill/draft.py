"""Training an EAGLE draft head (hasten.model.eagle) on its target's own behaviour.

Data: ShareGPT prompts answered by the target itself through hasten (self-distillation), plus
ShareGPT conversations read as they are. While hasten's engine computes them it hands over the
final hidden state f_t (after the final norm) of every token (`FeatureRecorder`), so the target
reads each token once. The head learns, at position t from (f_t + noise, embedding of x_{t+1}),
to predict f_{t+1}: a smooth-L1 regression on the feature plus the cross-entropy of the head's
reduced-vocabulary distribution against the target's distribution p(. | x_{<=t+1}) over that
vocabulary (the target's lm_head rows applied to f_{t+1}). Held out: the share of positions where
the head's greedy token is the target's greedy token (the first draft's acceptance under greedy
decoding).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hasten.distill.train import DistillConfig, TrainLoop
from hasten.model.eagle import EagleHead


@dataclass
class FeatureWindow:
    """One training or held-out window: tokens and what the target computed at each of them."""

    ids: torch.Tensor  # [T] long
    feats: torch.Tensor  # [T, hidden] float16: the target's final hidden state (after the final norm)
    greedy: torch.Tensor | None = None  # [T] long: the target's most likely next token (held-out windows)


class FeatureRecorder:
    """An engine hidden-state observer (Engine.add_hidden_observer) that keeps, per request, the
    final hidden state of every position the engine computes. Each request writes into one buffer
    that doubles as it fills: a decode step's single row is a copy, not an allocation (thousands of
    small live tensors between the step's large temporaries fragmented the heap by gigabytes)."""

    def __init__(self) -> None:
        self.buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # features [cap, hidden], written [cap]

    def observe(self, batch: Any, hidden: torch.Tensor) -> None:
        row = 0
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            feats, seen = self.buffers.get(req.request_id, (None, None))
            if feats is None or feats.shape[0] < end:
                cap = max(end, 256, 2 * (feats.shape[0] if feats is not None else 0))
                grown = torch.empty(cap, hidden.shape[1], dtype=torch.float16)
                grown_seen = torch.zeros(cap, dtype=torch.bool)
                if feats is not None:
                    grown[: feats.shape[0]] = feats
                    grown_seen[: seen.shape[0]] = seen
                feats, seen = grown, grown_seen
                self.buffers[req.request_id] = (feats, seen)
            feats[start:end] = hidden[row : row + n]  # a position computed again (a preemption) keeps the later rows
            seen[start:end] = True
            row += n

    def release(self, request_id: str) -> None:
        self.buffers.pop(request_id, None)

    def take(self, request_id: str, length: int) -> torch.Tensor | None:
        """Features of positions 0..length-1; None when some position was never computed."""
        feats, seen = self.buffers.pop(request_id, (None, None))
        if feats is None or feats.shape[0] < length or not bool(seen[:length].all()):
            return None
        return feats[:length].clone()


def chat_prompts(tokenizer: Any, texts: Sequence[str], max_prompt_tokens: int) -> list[list[int]]:
    """Each text as the user turn of a chat (the tokenizer's template), ready for the answer; texts
    longer than max_prompt_tokens are left out."""
    prompts = []
    templated = bool(getattr(tokenizer, "chat_template", None))
    for text in texts:
        if templated:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
        else:  # a tokenizer without a template: a plain transcript
            ids = tokenizer.encode(f"User: {text}\n\nAssistant:")
        if 0 < len(ids) <= max_prompt_tokens:
            prompts.append(list(ids))
    return prompts


def prompt_conversations(heldout: bool) -> Iterator[list[dict]]:
    """ShareGPT conversations for training prompts (from the first record) or held-out ones (from
    the evaluation offset), split by a hash of each conversation's JSON so the two never share one."""
    import json

    from hasten.quant.data import EVAL_OFFSET, is_evaluation_text, iter_conversations

    for conv in iter_conversations(EVAL_OFFSET if heldout else 0):
        if is_evaluation_text(json.dumps(conv)) == heldout:
            yield conv


def first_user_turns(conversations: Any, count: int, min_chars: int = 16, max_chars: int = 2000) -> list[str]:
    """The opening user turn of `count` ShareGPT conversations (of sensible length)."""
    out: list[str] = []
    for conv in conversations:
        turn = next((t.get("value", "") for t in conv if t.get("from") == "human"), "").strip()
        if min_chars <= len(turn) <= max_chars:
            out.append(turn)
            if len(out) >= count:
                break
    return out


def record(llm: Any, prompts: list[list[int]], max_tokens: int, seed: int = 0) -> list[FeatureWindow]:
    """Each prompt and the target's greedy answer (max_tokens of it; 1 reads a text as it is) with
    the target's feature at every position, from one pass of a hasten LLM (prefix caching off)."""
    from hasten import SamplingParams

    recorder = FeatureRecorder()
    llm.engine.add_hidden_observer(recorder)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=seed),
                            use_tqdm=False)
    finally:
        llm.engine.remove_hidden_observer(recorder)
    found = []
    for prompt, out in zip(prompts, outs, strict=True):
        ids = (list(prompt) + list(out.outputs[0].token_ids))[:-1]  # the last token was never read
        feats = recorder.take(out.request_id, len(ids))
        if feats is not None:
            found.append(FeatureWindow(torch.tensor(ids, dtype=torch.long), feats))
    return found


def windows_of(sequences: Sequence[FeatureWindow], seq_len: int, min_len: int = 16) -> list[FeatureWindow]:
    """Cut recorded sequences into windows of at most seq_len tokens (each inside one sequence)."""
    out = []
    for seq in sequences:
        for start in range(0, len(seq.ids), seq_len):
            if len(seq.ids) - start >= min_len:
                out.append(FeatureWindow(seq.ids[start : start + seq_len], seq.feats[start : start + seq_len]))
    return out


def reduced_vocabulary(windows: Sequence[torch.Tensor], size: int, always: Sequence[int], vocab_size: int) -> torch.Tensor:
    """The `size` most frequent tokens of the windows (ties to the lower id), plus `always`; sorted ids."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for w in windows:
        counts += torch.bincount(w, minlength=vocab_size)
    forced = [t for t in always if 0 <= t < vocab_size]
    counts[forced] = counts.max() + 1
    size = min(size, vocab_size)
    order = torch.argsort(-counts, stable=True)
    return torch.sort(order[:size]).values


@torch.no_grad()
def label_greedy(windows: Sequence[FeatureWindow], lm_head: torch.Tensor) -> None:
    """The target's greedy next token at every position of `windows` (from its features)."""
    w_full = lm_head.detach().float()
    for w in windows:
        w.greedy = (w.feats.float() @ w_full.T).argmax(-1)


@dataclass(frozen=True)
class HeadLoss:
    feature_weight: float = 1.0  # smooth-L1 on the predicted feature
    noise: float = 0.1  # uniform noise of this half-width on the input features (training only)
    unroll: int = 1  # drafting steps trained (2+: later drafts read the head's own predictions)
    step_decay: float = 0.8  # weight of step s is step_decay ** (s - 1)


class HeadTrainer(TrainLoop):
    """Trains an EagleHead on captured windows against the frozen target's embedding and lm_head."""

    metric = "heldout_top1"

    def __init__(self, head: EagleHead, embed: torch.Tensor, lm_head: torch.Tensor, train: list[FeatureWindow],
                 heldout: list[FeatureWindow], config: DistillConfig, loss: HeadLoss = HeadLoss(),
                 checkpoint_dir=None, signature: dict | None = None):
        self.head, self.loss_cfg, self.heldout = head, loss, heldout
        self.embed = embed.detach().float()  # [vocab, hidden], frozen
        self.sub_head = lm_head.detach().float()[head.token_map]  # the target's rows of the draft vocabulary
        super().__init__(head, train, config, checkpoint_dir, signature)

    def _inputs(self, w: FeatureWindow, noise: bool):
        feats = w.feats.float()
        feat_in = feats[:-1]
        if noise and self.loss_cfg.noise > 0:
            u = torch.rand(feat_in.shape)  # the global generator: a checkpoint holds its state
            feat_in = feat_in + (2 * u - 1) * self.loss_cfg.noise
        return self.embed[w.ids[1:]], feat_in, feats

    def losses(self, w: FeatureWindow, noise: bool = False, steps: int = 1
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cross-entropy against the target, feature regression, step 1's log-probabilities) of one
        window, summed over `steps` unrolled drafting steps with decaying weights."""
        emb, feat_in, feats = self._inputs(w, noise)
        preds = self.head.unrolled(emb, feat_in, steps)
        ce = reg = torch.zeros(())
        first = None
        for s, pred in enumerate(preds, start=1):
            target = feats[s : s + pred.shape[0]]
            logq = F.log_softmax(self.head.logits(pred).float(), -1)
            with torch.no_grad():
                p = torch.softmax(target @ self.sub_head.T, -1)
            weight = self.loss_cfg.step_decay ** (s - 1)
            ce = ce + weight * -(p * logq).sum(-1).mean()
            reg = reg + weight * F.smooth_l1_loss(pred, target)
            if first is None:
                first = logq
        return ce, reg, first

    def _step(self, batch: list[FeatureWindow]) -> float:
        c = self.config
        self.optimizer.zero_grad(set_to_none=True)
        total = sum(len(w.ids) - 1 for w in batch)
        loss_sum = 0.0
        for w in batch:
            ce, reg, _ = self.losses(w, noise=True, steps=self.loss_cfg.unroll)
            loss = ce + self.loss_cfg.feature_weight * reg
            (loss * ((len(w.ids) - 1) / total)).backward()
            loss_sum += float(loss.detach()) * (len(w.ids) - 1)
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), c.max_grad_norm)
        self.optimizer.step()
        self.schedule.step()
        return loss_sum / total

    @torch.no_grad()
    def evaluate(self) -> float:
        """Held-out share of positions where the head's greedy token is the target's."""
        was = self.head.training
        self.head.eval()
        hits = count = 0
        for w in self.heldout:
            _, _, logq = self.losses(w)
            guess = self.head.token_map[logq.argmax(-1)]
            hits += int((guess == w.greedy[1:]).sum())
            count += len(w.ids) - 1
        self.head.train(was)
        return hits / max(count, 1)


def init_head(head: EagleHead, lm_head: torch.Tensor, final_norm: torch.Tensor, token_map: torch.Tensor,
              seed: int) -> None:
    """Seeded small random weights; the draft lm_head starts as the target's rows, the final norm as
    the target's, so the head's output space is the target's feature space from the start."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        head.token_map.copy_(token_map)
        head.lm_head.weight.copy_(lm_head.float()[token_map])
        head.final_norm.copy_(final_norm.float())
