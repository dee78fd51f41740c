"""Turn a batch of logits rows into next tokens, one row per sequence being sampled.

Order of processing (as in vLLM): logits processors (e.g. JSON grammar) -> logit_bias -> min_tokens ->
penalties -> greedy argmax or temperature / top-k / top-p / min-p sampling. Logprobs
are those of the raw model distribution (before any processing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hasten.engine.request import Request
from hasten.outputs import TokenLogprobs


def apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> None:
    """Repetition (prompt + output), presence and frequency (output) penalties, in place."""
    rows = [i for i, r in enumerate(reqs) if r.params.needs_penalties]
    if not rows:
        return
    vocab = logits.shape[1]
    for i in rows:
        r, p = reqs[i], reqs[i].params
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(r.all_token_ids(), dtype=torch.long).unique()
            seen = seen[seen < vocab]
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
            counts = torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.long), minlength=vocab)[:vocab]
            row -= p.frequency_penalty * counts.to(row.dtype)
            row -= p.presence_penalty * (counts > 0).to(row.dtype)


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                            needs: tuple[bool, bool, bool] | None = None):
    """Mask (to -inf) tokens outside top-k / nucleus top-p / below min_p * max prob. Batched.
    needs: whether any row uses (min_p, top_k, top_p), when the caller already knows (the device sampler
    decides on the host, so nothing waits for the device); None: read from the tensors."""
    need_min_p, need_k, need_p = needs if needs is not None else (
        bool((min_p > 0).any()), bool((top_k > 0).any()), bool((top_p < 1.0).any()))
    if need_min_p:
        probs = logits.softmax(-1)
        thresh = probs.max(-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    if not (need_k or need_p):
        return logits
    sorted_logits, order = logits.sort(-1, descending=True)
    vocab = logits.shape[1]
    if need_k:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if need_p:
        probs = sorted_logits.softmax(-1)
        cum = probs.cumsum(-1)
        # drop a token if the tokens strictly before it already reach top_p (keep at least one)
        drop = (cum - probs) >= top_p.unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


_CHUNK = 256  # tokens per first-level step of draw_with_uniforms


def draw_with_uniforms(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [n, V] given float64 uniforms u [n, 1] in [0, 1) on its device:
    the first token whose cumulative probability exceeds u * total. Two levels, so only sums are
    taken over the whole vocabulary: the chunk of 256 tokens holding u (cumulative chunk sums), then
    the token inside it (chunk sums in float32, cumulative sums in float64). A token of probability
    0 is never picked. Batched tensor ops only: no value is read back to the host."""
    n, vocab = probs.shape
    pad = -vocab % _CHUNK
    chunks = (F.pad(probs, (0, pad)) if pad else probs).view(n, -1, _CHUNK)
    sums = chunks.sum(-1).double()
    ccdf = sums.cumsum(-1)
    target = u * ccdf[:, -1:]
    last_chunk = (ccdf < ccdf[:, -1:]).sum(-1, keepdim=True)  # the last chunk with any mass
    c = torch.minimum(torch.searchsorted(ccdf, target, right=True), last_chunk)
    inner = chunks[torch.arange(n, device=probs.device), c.squeeze(1)].double().cumsum(-1)
    last_token = (inner < inner[:, -1:]).sum(-1, keepdim=True)  # the chunk's last token with mass
    k = torch.minimum(torch.searchsorted(inner, target - (ccdf.gather(1, c) - sums.gather(1, c)), right=True),
                      last_token)
    return (c * _CHUNK + k).squeeze(1)


class Sampler:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(0)

    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    @staticmethod
    def changes_logits(r: Request) -> bool:
        """Whether process() changes this request's row: logits processors, logit_bias, min_tokens
        masking still in force, or penalties."""
        p = r.params
        return bool(p.logits_processors or r.num_output_tokens < p.min_tokens or p.needs_penalties or p.logit_bias)

    @staticmethod
    def process(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Logits processors, min_tokens and penalties, on a copy (the input itself when no row needs
        any of them: it is only read afterwards). Each row's context is its request's outputs."""
        if not any(Sampler.changes_logits(r) for r in reqs):
            return logits
        logits = logits.clone()
        for i, r in enumerate(reqs):
            for proc in r.params.logits_processors:
                proc(r.output_token_ids, logits[i])
            if r.params.logit_bias:
                bias = r.params.logit_bias
                logits[i, list(bias)] += torch.tensor(list(bias.values()), dtype=logits.dtype)
            if r.num_output_tokens < r.params.min_tokens:
                banned = list(r.params.stop_token_ids or [])
                if not r.params.ignore_eos:
                    banned += r.eos_token_ids
                if banned:
                    kept = logits[i].clone()
                    logits[i, banned] = float("-inf")
                    if not bool(torch.isfinite(logits[i]).any()):  # e.g. a finished grammar allows only EOS
                        logits[i] = kept
        apply_penalties(logits, reqs)
        return logits

    @staticmethod
    def probs(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """The distribution sampled from: temperature, then top-k / top-p / min-p, then softmax."""
        ps = [r.params for r in reqs]
        temps = [max(p.temperature, 1e-5) for p in ps]
        # x / 1.0 is x: a batch at temperature 1 (the API's default) skips the division (~0.4 ms at 32 x 49152)
        scaled = logits if all(t == 1.0 for t in temps) else logits / torch.tensor(temps, dtype=logits.dtype).unsqueeze(1)
        filtered = apply_top_k_top_p_min_p(
            scaled,
            torch.tensor([p.top_k for p in ps]),
            torch.tensor([p.top_p for p in ps], dtype=logits.dtype),
            torch.tensor([p.min_p for p in ps], dtype=logits.dtype),
        )
        return filtered.softmax(-1)

    def noise_for(self, req: Request, shape: tuple[int, ...]) -> torch.Tensor:
        """Exp(1) noise from the request's own generator when it has a seed, else the shared one."""
        return torch.empty(shape).exponential_(generator=req.generator or self.generator)

    def uniform_for(self, req: Request) -> float:
        return float(torch.rand((), generator=req.generator or self.generator))

    def draw(self, probs: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """One token per row of `probs` by inverse CDF (draw_with_uniforms), with a uniform u per row
        from the request's own generator when it has a seed, so its draws do not depend on the rest
        of the batch, else from the shared generator. One random number per row (an exponential
        race needs one per vocabulary entry)."""
        n = probs.shape[0]
        u = torch.empty(n, 1, dtype=torch.float64)
        unseeded = [j for j, r in enumerate(reqs) if r.generator is None]
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), 1, generator=self.generator, dtype=torch.float64)
        for j, r in enumerate(reqs):
            if r.generator is not None:
                u[j] = torch.rand((), generator=r.generator, dtype=torch.float64)
        return draw_with_uniforms(probs, u.to(probs.device))

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [n, V] float32, one row per request. Returns tokens and (optional) logprobs."""
        raw = logits
        logits = self.process(logits, reqs)
        tokens = torch.empty(len(reqs), dtype=torch.long)
        greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
        # max's indices are argmax's (the first maximal entry; NaN counts as the maximum) at about half
        # its cost on the CPU (32 x 49152 float32: ~0.6 against ~1.2 ms); no row copy when all are greedy
        if len(greedy) == len(reqs):
            tokens = logits.max(-1).indices
        elif greedy:
            idx = torch.tensor(greedy)
            tokens[idx] = logits[idx].max(-1).indices
        rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if len(rand) == len(reqs):  # no row copies when every request samples
            tokens = self.draw(self.probs(logits, reqs), reqs)
        elif rand:
            idx = torch.tensor(rand)
            probs = self.probs(logits[idx], [reqs[i] for i in rand])
            tokens[idx] = self.draw(probs, [reqs[i] for i in rand])
        token_list = tokens.tolist()
        return token_list, logprobs_for(raw, reqs, token_list)


def logprobs_for(raw: torch.Tensor, reqs: list[Request], tokens: list[int]) -> list[TokenLogprobs | None]:
    """Logprob of each chosen token plus the request's top-n alternatives, from raw logits rows."""
    lps: list[TokenLogprobs | None] = [None] * len(reqs)
    want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    if not want:
        return lps
    logp = raw[torch.tensor(want)].log_softmax(-1)
    k = max(reqs[i].params.logprobs or 0 for i in want)
    top_v = top_i = None
    if k:
        top_v, top_i = logp.topk(k, -1)
        top_v, top_i = top_v.tolist(), top_i.tolist()
    for j, i in enumerate(want):
        tok = tokens[i]
        d: TokenLogprobs = {tok: float(logp[j, tok])}
        n = reqs[i].params.logprobs or 0
        for v, t in zip(top_v[j][:n] if n else [], top_i[j][:n] if n else [], strict=True):
            d.setdefault(t, v)
        lps[i] = d
    return lps


def prompt_logprobs_for(logits: torch.Tensor, next_tokens: list[int], k: int) -> list[TokenLogprobs]:
    """Logprobs of each actual next prompt token (plus top-k) given rows of prompt logits."""
    logp = logits.log_softmax(-1)
    target = torch.tensor(next_tokens, dtype=torch.long)
    chosen = logp.gather(1, target.unsqueeze(1)).squeeze(1).tolist()
    out: list[TokenLogprobs] = []
    top_v = top_i = None
    if k:
        top_v, top_i = logp.topk(k, -1)
        top_v, top_i = top_v.tolist(), top_i.tolist()
    for j, tok in enumerate(next_tokens):
        d: TokenLogprobs = {tok: chosen[j]}
        if k:
            for v, t in zip(top_v[j], top_i[j], strict=True):
                d.setdefault(t, v)
        out.append(d)
    return out
