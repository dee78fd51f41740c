"""A stand-in for `hasten.engine.async_engine.AsyncLLM`, with exactly its interface.

It schedules like a real engine - a loop steps every `step_time` seconds, admits
waiting requests in priority order while KV blocks and batch slots last, and produces
one token per running sequence per step - so queueing, cancellation, block accounting,
the waiting-queue limit and per-request timestamps can all be tested without torch.

The "model" writes a fixed script (FAKE_TEXT, cycled) one byte-token at a time with
temperature 0; with temperature > 0 it picks random words from a seeded generator, and
ends with EOS after `eos_after` tokens unless `ignore_eos`. When a request carries
logits processors (structured output) it builds a torch logits row that prefers
JSON-closing characters, runs the processors on it and takes the argmax.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from hasten.engine.stats import EngineStats, QueueFullError
from hasten.outputs import CompletionOutput, RequestMetrics, RequestOutput
from hasten.sampling_params import SamplingParams

FAKE_TEXT = "the quick brown fox jumps over the lazy dog. "
CRASH_MARKER = "<<crash>>"  # a prompt containing this fails after its first token
WORDS = ["alpha ", "beta ", "gamma ", "delta ", "omega ", "pi "]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer() -> Any:
    """A real `PreTrainedTokenizerFast`: byte-level, one token per byte, plus 3 special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)


@dataclass
class _Seq:
    index: int
    rng: random.Random
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_text: int = 0


@dataclass
class _Req:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    metrics: RequestMetrics
    queue: asyncio.Queue
    seqs: list[_Seq]
    blocks: int = 0
    cached: int = 0
    done: bool = False


class FakeAsyncLLM:
    def __init__(self, tokenizer: Any = None, model_name: str = "fake-model", max_model_len: int = 256,
                 max_num_seqs: int = 8, max_waiting: int = 64, step_time: float = 0.002,
                 num_blocks: int = 256, block_size: int = 16, eos_after: int = 40,
                 start_delay: float = 0.0) -> None:
        self.tokenizer = tokenizer or make_tokenizer()
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.step_time = step_time
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.eos_after = eos_after
        self.start_delay = start_delay
        self.free_blocks = num_blocks
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.steps = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._seen_prompts: set[tuple[int, ...]] = set()
        self._task: asyncio.Task | None = None
        self._script = self.tokenizer.encode(FAKE_TEXT, add_special_tokens=False)
        self._words = [self.tokenizer.encode(w, add_special_tokens=False) for w in WORDS]
        self.eos_id: int = self.tokenizer.eos_token_id
        self.aborted: list[str] = []
        self.seen_params: list[SamplingParams] = []
        self.seen_priorities: list[int] = []
        self.seen_salts: list[str | None] = []
        self.paused = False  # tests set it to freeze the queues: the loop then runs no steps

    @classmethod
    def from_options(cls, model: str | None = None, **options: Any) -> FakeAsyncLLM:
        return cls(model_name=model or "fake-model", **options)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                       tokenize=True, return_dict=False))

    async def start(self) -> None:
        if self.start_delay:
            await asyncio.sleep(self.start_delay)
        self._task = asyncio.create_task(self._loop())

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def get_stats(self) -> EngineStats:
        used = self.num_blocks - self.free_blocks
        return EngineStats(len(self.running), len(self.waiting), used / self.num_blocks, self.free_blocks,
                           self.num_blocks, self.prefix_queries, self.prefix_hits, 0)

    async def abort(self, request_id: str) -> None:
        for lst in (self.waiting, self.running):
            for r in list(lst):
                if r.request_id == request_id:
                    self._release(r, lst)
                    self.aborted.append(request_id)

    # ---- generation ---------------------------------------------------------------------
    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                 priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        self.seen_salts.append(cache_salt)
        return self._generate(prompt, params, request_id, priority)

    async def _generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                        priority: int) -> AsyncIterator[RequestOutput]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = params.max_tokens or (self.max_model_len - len(ids))
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)}) + max_tokens ({max_tokens}) > max_model_len "
                             f"({self.max_model_len})")
        if len(self.waiting) >= self.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.max_waiting})")
        self.seen_params.append(params)
        self.seen_priorities.append(priority)
        base_seed = params.seed if params.seed is not None else random.randrange(2**31)
        seqs = [_Seq(i, random.Random(base_seed * 1000 + i)) for i in range(params.n)]
        req = _Req(request_id, prompt if isinstance(prompt, str) else None, ids, params, priority,
                   RequestMetrics(arrival_time=time.time(), num_prompt_tokens=len(ids)), asyncio.Queue(), seqs)
        self.waiting.append(req)
        finished = False
        crash = CRASH_MARKER in self.tokenizer.decode(ids)
        try:
            while True:
                out = await req.queue.get()
                finished = out.finished
                yield out
                if crash:
                    raise RuntimeError("simulated engine failure for this request")
                if finished:
                    return
        finally:
            if not finished:
                await self.abort(request_id)

    def _release(self, req: _Req, lst: list[_Req]) -> None:
        if req in lst:
            lst.remove(req)
            self.free_blocks += req.blocks
            req.blocks = 0

    def _blocks_needed(self, req: _Req) -> int:
        tokens = len(req.prompt_ids) + max(len(s.token_ids) for s in req.seqs) + 1
        return math.ceil(tokens / self.block_size) * len(req.seqs)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.step_time)
            if not self.paused:
                self.step()

    def step(self) -> None:
        self.steps += 1
        now = time.time()
        self.waiting.sort(key=lambda r: (r.priority, r.metrics.arrival_time))
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            need = self._blocks_needed(req)
            if need > self.free_blocks:
                break
            self.waiting.pop(0)
            req.blocks, self.free_blocks = need, self.free_blocks - need
            req.metrics.first_scheduled_time = now
            key = tuple(req.prompt_ids)
            self.prefix_queries += len(key)
            if key in self._seen_prompts:
                req.cached = (len(key) - 1) // self.block_size * self.block_size
                self.prefix_hits += req.cached
            self._seen_prompts.add(key)
            self.running.append(req)
        for req in list(self.running):
            self._advance(req, now)

    def _advance(self, req: _Req, now: float) -> None:
        p = req.params
        for seq in req.seqs:
            if seq.finish_reason is None:
                self._next_token(req, seq)
        need = self._blocks_needed(req)
        grow = need - req.blocks
        if grow > 0:
            self.free_blocks -= grow
            req.blocks = need
        m = req.metrics
        m.token_times.append(now)
        m.first_token_time = m.first_token_time or now
        m.last_token_time = now
        done = all(s.finish_reason is not None for s in req.seqs)
        if done:
            m.finished_time = now
            self._release(req, self.running)
        outs = []
        # Like a real detokenizer, hold back text that could still turn out to be part of a stop string.
        hold = max((len(s) for s in p.stop), default=1) - 1
        for seq in req.seqs:
            visible = len(seq.text) if seq.finish_reason else max(seq.sent_text, len(seq.text) - hold)
            outs.append(CompletionOutput(
                index=seq.index, text=seq.text[:visible], token_ids=list(seq.token_ids),
                cumulative_logprob=sum(lp[t] for lp, t in zip(seq.logprobs, seq.token_ids, strict=False)),
                logprobs=list(seq.logprobs) if p.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                delta_text=seq.text[seq.sent_text:visible], delta_token_ids=seq.token_ids[seq.sent_tokens:],
                delta_logprobs=seq.logprobs[seq.sent_tokens:] if p.logprobs is not None else None))
            seq.sent_text, seq.sent_tokens = visible, len(seq.token_ids)
        prompt_lps = None
        if p.prompt_logprobs is not None:
            prompt_lps = [None] + [{t: -1.0} for t in req.prompt_ids[1:]]
        req.queue.put_nowait(RequestOutput(req.request_id, req.prompt, req.prompt_ids, outs, done,
                                           prompt_logprobs=prompt_lps, metrics=m if done else None,
                                           num_cached_tokens=req.cached))

    def _next_token(self, req: _Req, seq: _Seq) -> None:
        p = req.params
        pos = len(seq.token_ids)
        if p.logits_processors:
            token = self._constrained_token(seq, p)
        elif pos >= self.eos_after and not p.ignore_eos:
            token = self.eos_id
        elif p.greedy:
            token = self._script[pos % len(self._script)]
        else:
            if not getattr(seq, "pending", None):
                seq.pending = list(seq.rng.choice(self._words))  # type: ignore[attr-defined]
            token = seq.pending.pop(0)  # type: ignore[attr-defined]
        others = [t for t in (token + 1, token + 2, token + 3) if t < len(self.tokenizer)]
        seq.logprobs.append({token: -0.5, **{t: -1.5 - i for i, t in enumerate(others)}})
        seq.token_ids.append(token)
        if token == self.eos_id and not p.ignore_eos:
            seq.finish_reason, seq.stop_reason = "stop", None
            return
        piece = self.tokenizer.decode([token], skip_special_tokens=p.skip_special_tokens)
        seq.text += piece
        for stop in p.stop:
            at = seq.text.find(stop)
            if at >= 0:
                seq.text = seq.text[: at + (len(stop) if p.include_stop_str_in_output else 0)]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return
        if p.max_tokens is not None and len(seq.token_ids) >= p.max_tokens:
            seq.finish_reason = "length"

    def _constrained_token(self, seq: _Seq, p: SamplingParams) -> int:
        import torch

        vocab = len(self.tokenizer) + 5  # like a model whose vocab is padded past the tokenizer's
        scores = torch.zeros(vocab)
        prefs = {self.eos_id: 10.0}
        for ch, score in zip('}]"0a1,:', (9.0, 8.5, 8.0, 7.0, 6.0, 5.5, 5.0, 4.0), strict=True):
            prefs[self.tokenizer.encode(ch, add_special_tokens=False)[0]] = score
        for t, s in prefs.items():
            scores[t] = s
        if not p.greedy:
            gen = torch.Generator().manual_seed(seq.rng.randrange(2**31))
            scores += torch.randn(vocab, generator=gen) * 3.0 * p.temperature
        for proc in p.logits_processors:
            proc(list(seq.token_ids), scores)
        return int(torch.argmax(scores))
