"""Batched sampling on the logits' device, without a host round trip per request.

`DeviceSampler` has the interface and the results of hasten.engine.sampler.Sampler (the same
processing order, the same float ops, so process / probs / greedy tokens are bit-identical on
float32), with every per-request tensor op replaced by batched ops on `logits.device`:

* per-row parameters (temperature, top-k / top-p / min-p, penalties, logit_bias and min_tokens
  indices, penalty token ids, seeds / offsets, row indices) are gathered on the host into one
  int64 and one float64 tensor and copied to the device once per call (pinned, non_blocking, on
  CUDA); the "is any row using top-k / top-p / min-p" decisions are made on the host;
* penalties: a padded [rows, L] token-id tensor (prompt + output for repetition, output for
  presence / frequency), counted with scatter_add into [rows, V + 1] (column V takes the padding);
* logit_bias and min_tokens bans: index_put over (row, token) index tensors; a banned row left
  without a finite logit is restored, as in Sampler.process;
* logits processors (structured output) still run row by row, on the rows that have them;
* random rows: one uniform per row, from the Philox kernel of hasten.kernels.triton.sampling when
  Triton runs on the device (seeded request: key = its seed, counter = its number of generated
  tokens, so the same seed gives the same tokens in any batch; unseeded rows: a per-call key
  drawn from the shared generator, counter = the row's position), else from the torch generators
  exactly as Sampler.draw does; then draw_with_uniforms, the inverse-CDF draw Sampler uses.

The one device -> host transfer of `sample` is a single .tolist() of the tokens, with the chosen
logprobs and the top-n alternatives packed in when some request asks for logprobs.
"""

from __future__ import annotations

import torch

from hasten.engine.request import Request
from hasten.engine.sampler import Sampler, apply_top_k_top_p_min_p, draw_with_uniforms
from hasten.kernels import triton as triton_kernels
from hasten.outputs import TokenLogprobs

# columns of the float64 per-row parameter table used by probs
_TEMP, _TOP_P, _MIN_P, _TOP_K = range(4)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: from pinned memory without blocking the host on CUDA."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class _Batch:
    """Named host segments, packed into one int64 and one float64 tensor and uploaded once;
    indexing by name gives the segment's view on the device."""

    def __init__(self) -> None:
        self._vals: dict[bool, list] = {False: [], True: []}
        self._seg: dict[str, tuple[bool, int, int, tuple[int, ...]]] = {}
        self._dev: dict[bool, torch.Tensor] = {}
        self.host: dict[str, torch.Tensor] = {}  # host tensors some decisions are made on

    def put(self, name: str, values: list, shape: tuple[int, ...] | None = None, floating: bool = False) -> None:
        vals = self._vals[floating]
        self._seg[name] = (floating, len(vals), len(vals) + len(values), shape or (len(values),))
        vals.extend(values)

    def upload(self, device: torch.device) -> _Batch:
        for floating, vals in self._vals.items():
            if vals:
                host = torch.tensor(vals, dtype=torch.float64 if floating else torch.int64)
                self._dev[floating] = _to_device(host, device)
        return self

    def __contains__(self, name: str) -> bool:
        return name in self._seg

    def __getitem__(self, name: str) -> torch.Tensor:
        floating, a, b, shape = self._seg[name]
        return self._dev[floating][a:b].view(shape)


class DeviceSampler(Sampler):
    """Sampler whose per-request loops are batched tensor ops on the logits' device.

    use_triton: None picks the Philox kernel where hasten.kernels.triton.usable_on(device), True
    requires it, False always takes the torch generators (Sampler's uniforms, bit for bit)."""

    def __init__(self, vocab_size: int, device: torch.device | str | None = None,
                 use_triton: bool | None = None) -> None:
        super().__init__(vocab_size)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.use_triton = use_triton

    def _triton_on(self, device: torch.device) -> bool:
        if self.use_triton is None:
            return triton_kernels.usable_on(device)
        return self.use_triton

    # -- host-side planning: what each stage needs, as named segments of one batch --------------

    @staticmethod
    def _plan_process(b: _Batch, reqs: list[Request], vocab: int) -> bool:
        """Segments for logit_bias, min_tokens bans and penalties; whether any row needs processing."""
        bias_r: list[int] = []
        bias_c: list[int] = []
        bias_v: list[float] = []
        ban_rows: list[int] = []
        ban_r: list[int] = []
        ban_c: list[int] = []
        pen: list[int] = []
        procs = False
        for i, r in enumerate(reqs):
            p = r.params
            procs = procs or bool(p.logits_processors)
            if p.logit_bias:
                bias_r += [i] * len(p.logit_bias)
                bias_c += list(p.logit_bias)
                bias_v += list(p.logit_bias.values())
            if r.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids or []) + ([] if p.ignore_eos else list(r.eos_token_ids))
                if banned:
                    ban_r += [len(ban_rows)] * len(banned)
                    ban_c += banned
                    ban_rows.append(i)
            if p.needs_penalties:
                pen.append(i)
        if any(c >= vocab for c in bias_c + ban_c):  # Sampler's indexing raises here too
            raise IndexError(f"a logit_bias / stop / eos token id is outside the vocabulary of {vocab}")
        if bias_r:
            b.put("bias_r", bias_r)
            b.put("bias_c", bias_c)
            b.put("bias_v", bias_v, floating=True)
        if ban_rows:
            b.put("ban_rows", ban_rows)
            b.put("ban_r", ban_r)
            b.put("ban_c", ban_c)
        if pen:
            ps = [reqs[i].params for i in pen]
            toks = [(reqs[i].prompt_token_ids if p.repetition_penalty != 1.0 else []) + reqs[i].output_token_ids
                    for i, p in zip(pen, ps, strict=True)]
            width = max(1, max(len(t) for t in toks))
            b.put("pen_rows", pen)
            b.put("pen_ids", [x for t in toks for x in t + [vocab] * (width - len(t))], (len(pen), width))
            # where each row's output tokens start in its padded row (presence / frequency count those)
            b.put("pen_start", [len(t) - reqs[i].num_output_tokens for i, t in zip(pen, toks, strict=True)])
            b.put("pen_f", [v for p in ps for v in (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)],
                  (len(pen), 3), floating=True)
            b.host["pen_flags"] = torch.tensor(
                [any(p.repetition_penalty != 1.0 for p in ps), any(p.frequency_penalty or p.presence_penalty
                                                                   for p in ps)])
        return procs or bool(bias_r or ban_rows or pen)

    @staticmethod
    def _plan_probs(b: _Batch, reqs: list[Request]) -> None:
        ps = [r.params for r in reqs]
        rows = [[max(p.temperature, 1e-5), p.top_p, p.min_p, float(p.top_k)] for p in ps]
        b.put("probs", [v for row in rows for v in row], (len(ps), 4), floating=True)
        b.host["probs"] = torch.tensor(rows, dtype=torch.float64).view(len(ps), 4)

    def _plan_draw(self, b: _Batch, reqs: list[Request], device: torch.device) -> None:
        if self._triton_on(device):
            from hasten.kernels.triton.sampling import as_int64_seed

            call_seed = 0
            if any(r.params.seed is None for r in reqs):
                call_seed = int(torch.randint(-(2**63), 2**63 - 1, (), generator=self.generator))
            b.put("seed", [call_seed if r.params.seed is None else as_int64_seed(r.params.seed) for r in reqs])
            b.put("offset", [j if r.params.seed is None else r.num_output_tokens for j, r in enumerate(reqs)])
            return
        # the torch generators, consumed exactly as Sampler.draw consumes them
        u = [0.0] * len(reqs)
        unseeded = [j for j, r in enumerate(reqs) if r.generator is None]
        if unseeded:
            for j, x in zip(unseeded, torch.rand(len(unseeded), 1, generator=self.generator,
                                                 dtype=torch.float64).flatten().tolist(), strict=True):
                u[j] = x
        for j, r in enumerate(reqs):
            if r.generator is not None:
                u[j] = float(torch.rand((), generator=r.generator, dtype=torch.float64))
        b.put("u", u, (len(reqs), 1), floating=True)

    # -- device-side stages ------------------------------------------------------------------------

    @staticmethod
    def _process(logits: torch.Tensor, reqs: list[Request], b: _Batch) -> torch.Tensor:
        logits = logits.clone()
        for i, r in enumerate(reqs):  # structured output: only the rows that have processors
            for proc in r.params.logits_processors:
                proc(r.output_token_ids, logits[i])
        if "bias_r" in b:
            rows, cols = b["bias_r"], b["bias_c"]
            logits[rows, cols] = logits[rows, cols] + b["bias_v"].to(logits.dtype)
        if "ban_rows" in b:
            rows = b["ban_rows"]
            kept = logits.index_select(0, rows)
            banned = kept.clone()
            banned[b["ban_r"], b["ban_c"]] = float("-inf")
            ok = torch.isfinite(banned).any(-1, keepdim=True)  # else restore the row (e.g. grammar allows only EOS)
            logits.index_copy_(0, rows, torch.where(ok, banned, kept))
        if "pen_rows" in b:
            rows, vocab = b["pen_rows"], logits.shape[1]
            sub = logits.index_select(0, rows)
            ids = b["pen_ids"].clamp(max=vocab)  # ids past the vocabulary count in the padding column
            f = b["pen_f"].to(logits.dtype)
            rep, freq, pres = f[:, 0:1], f[:, 1:2], f[:, 2:3]
            do_rep, do_counts = b.host["pen_flags"].tolist()
            if do_rep:
                seen = torch.zeros(ids.shape[0], vocab + 1, device=ids.device).scatter_add_(
                    1, ids, torch.ones(ids.shape, device=ids.device))[:, :vocab] > 0
                sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
            if do_counts:
                cols = torch.arange(ids.shape[1], device=ids.device)
                is_out = (cols.unsqueeze(0) >= b["pen_start"].unsqueeze(1)).float()
                counts = torch.zeros(ids.shape[0], vocab + 1, device=ids.device).scatter_add_(1, ids, is_out)
                counts = counts[:, :vocab]
                sub = sub - freq * counts.to(sub.dtype)
                sub = sub - pres * (counts > 0).to(sub.dtype)
            logits.index_copy_(0, rows, sub)
        return logits

    @staticmethod
    def _probs(logits: torch.Tensor, b: _Batch) -> torch.Tensor:
        """Temperature, top-k / top-p / min-p (apply_top_k_top_p_min_p, its "any row" tests made on the
        host), softmax."""
        dt = logits.dtype
        prm, host = b["probs"], b.host["probs"]
        logits = logits / prm[:, _TEMP].to(dt).unsqueeze(1)
        top_k, top_p, min_p = prm[:, _TOP_K].long(), prm[:, _TOP_P].to(dt), prm[:, _MIN_P].to(dt)
        needs = (bool((host[:, _MIN_P].to(dt) > 0).any()), bool((host[:, _TOP_K] > 0).any()),
                 bool((host[:, _TOP_P].to(dt) < 1.0).any()))
        logits = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p, needs)
        return logits.softmax(-1)

    @staticmethod
    def _draw(probs: torch.Tensor, b: _Batch) -> torch.Tensor:
        if "u" in b:
            return draw_with_uniforms(probs, b["u"])
        from hasten.kernels.triton.sampling import uniform_rows

        return draw_with_uniforms(probs, uniform_rows(b["seed"], b["offset"]).unsqueeze(1))

    # -- the public interface of Sampler -------------------------------------------------------------

    def process(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        self.device = logits.device
        b = _Batch()
        if not self._plan_process(b, reqs, logits.shape[1]):
            return logits
        return self._process(logits, reqs, b.upload(logits.device))

    def probs(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        self.device = logits.device
        b = _Batch()
        self._plan_probs(b, reqs)
        return self._probs(logits, b.upload(logits.device))

    def draw(self, probs: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        self.device = probs.device
        b = _Batch()
        self._plan_draw(b, reqs, probs.device)
        return self._draw(probs, b.upload(probs.device))

    def noise_for(self, req: Request, shape: tuple[int, ...]) -> torch.Tensor:
        """Sampler's Exp(1) noise (from the request's generator), on the device last sampled on."""
        return super().noise_for(req, shape).to(self.device)

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [n, V] on the device, one row per request. Returns tokens and (optional) logprobs."""
        device, n = logits.device, len(reqs)
        self.device = device
        greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
        rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
        want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        b = _Batch()
        needs_process = self._plan_process(b, reqs, logits.shape[1])
        if rand:
            rand_reqs = [reqs[i] for i in rand]
            self._plan_probs(b, rand_reqs)
            self._plan_draw(b, rand_reqs, device)
        if greedy and rand:
            b.put("greedy", greedy)
            b.put("rand", rand)
        if want:
            b.put("want", want)
        b.upload(device)
        processed = self._process(logits, reqs, b) if needs_process else logits
        if not rand:
            tokens = processed.argmax(-1)
        elif not greedy:
            tokens = self._draw(self._probs(processed, b), b)
        else:
            tokens = torch.empty(n, dtype=torch.long, device=device)
            tokens[b["greedy"]] = processed[b["greedy"]].argmax(-1)
            tokens[b["rand"]] = self._draw(self._probs(processed[b["rand"]], b), b)
        if not want:
            return tokens.tolist(), [None] * n
        # logprobs of the raw distribution, as logprobs_for computes them, packed with the tokens
        w = b["want"]
        logp = logits[w].log_softmax(-1)
        chosen = logp.gather(1, tokens[w].unsqueeze(1))
        k = max(reqs[i].params.logprobs or 0 for i in want)
        parts = [tokens.double(), chosen.double().flatten()]
        if k:
            top_v, top_i = logp.topk(k, -1)
            parts += [top_v.double().flatten(), top_i.double().flatten()]
        flat = torch.cat(parts).tolist()  # the one device -> host transfer
        token_list = [int(t) for t in flat[:n]]
        m = len(want)
        lps: list[TokenLogprobs | None] = [None] * n
        for j, i in enumerate(want):
            d: TokenLogprobs = {token_list[i]: flat[n + j]}
            top = reqs[i].params.logprobs or 0
            for a in range(top):
                d.setdefault(int(flat[n + m + m * k + j * k + a]), flat[n + m + j * k + a])
            lps[i] = d
        return token_list, lps
