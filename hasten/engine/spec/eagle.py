"""EAGLE proposer: a trained one-layer head (hasten.model.eagle) drafts from the target's own features.

The target's runner hands over the final hidden state of every token of every step
(`observe`). For each request the proposer keeps the features of positions the target has
computed but the head has not read yet, and the head's own K/V for positions first..cached-1
(entry p is made from the target's feature f_p and the embedding of token p+1). Proposing first
catches the head up to the request's newest real token, whose entry predicts the feature that
gives draft token 1; each further draft feeds the predicted feature back with the embedding of
the draft just made. Those speculative entries are overwritten next time: after verification the
target's own features replace them. Features of rejected drafts are dropped the same way,
because the next step's rows start at the first position the target has not kept.

A prefix-cache hit (or any gap) leaves positions without features: the head then starts its
cache at the first position it has a feature for. Drafts are sampled from the head's distribution
after the request's own processing (penalties, temperature, top-k/top-p), as the draft-model
proposer does, and those rows go to the distribution-exact verifier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hasten.engine.request import Request
from hasten.engine.scheduler import ScheduledBatch
from hasten.engine.spec.draft import draw_draft, proposal_view
from hasten.model.eagle import EagleHead, tokenizer_fingerprint


@dataclass
class _HeadState:
    k: torch.Tensor  # [capacity, kv heads, head dim]: entry p at index p - first
    v: torch.Tensor
    first: int = 0  # the position of the head's first entry
    cached: int = 0  # entries first..cached-1 are made from the target's features
    feat_pos: int = 0  # position of feats[0]
    feats: torch.Tensor | None = None  # target features of positions feat_pos.. (the tail may be rejected drafts')


class EagleProposer:
    name = "eagle"
    wants_hidden = True  # the engine's runner keeps each step's final hidden states for observe()

    def __init__(self, folder: str, engine):
        if engine.parallel is not None or engine.device_path:
            raise ValueError("speculative='eagle:...' runs on the one-process CPU engine (not with tensor / "
                             "pipeline parallelism or the device path yet)")
        self.head = EagleHead.load(folder, torch.float32)
        quant = engine.config.speculative_draft_quantization or "int8"  # 7x faster per draft than float32
        if quant not in ("none", "int8"):
            raise ValueError(f"an EAGLE head is served in int8 (the default) or float32 "
                             f"(speculative_draft_quantization='none'), not {quant!r}")
        if quant == "int8":
            self.head.quantize_int8()
        self.head.check_target(engine.model_config, tokenizer_fingerprint(engine.tokenizer))
        self.target = engine.model
        self.sampler = engine.sampler
        self.vocab_size = engine.model_config.vocab_size
        self.states: dict[str, _HeadState] = {}
        self.name = f"eagle:{folder}"

    # ------------------------------------------------------------ features in
    def observe(self, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        """The step's final hidden states [sum of new tokens, hidden], in batch order; call before the
        requests' num_computed_tokens move on."""
        row = 0
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            rows = hidden[row : row + n]
            row += n
            start = req.num_computed_tokens
            st = self.states.get(req.request_id)
            if st is None:
                st = self._new_state(start)
                self.states[req.request_id] = st
            if st.feats is not None and st.feat_pos <= start <= st.feat_pos + st.feats.shape[0]:
                st.feats = torch.cat([st.feats[: start - st.feat_pos], rows.float()])  # rejected drafts' rows go
            else:
                st.feat_pos, st.feats = start, rows.float().clone()

    def _new_state(self, first: int) -> _HeadState:
        c = self.head.cfg
        empty = torch.zeros(64, c.num_kv_heads, c.head_dim)
        return _HeadState(empty, empty.clone(), first, first, first, None)

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    # ------------------------------------------------------------ the head's cache
    @staticmethod
    def _reserve(st: _HeadState, upto: int) -> None:
        """Room for entries up to position `upto` (exclusive)."""
        need = upto - st.first
        if need > st.k.shape[0]:
            cap = max(need, 2 * st.k.shape[0])
            grow = cap - st.k.shape[0]
            pad = st.k.new_zeros((grow, *st.k.shape[1:]))
            st.k, st.v = torch.cat([st.k, pad]), torch.cat([st.v, pad.clone()])

    def _attend(self, st: _HeadState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int) -> torch.Tensor:
        """Write entries pos..pos+n-1 and attend their queries causally over entries first..pos+n-1."""
        c = self.head.cfg
        n = q.shape[0]
        self._reserve(st, pos + n)
        lo = pos - st.first
        st.k[lo : lo + n] = k
        st.v[lo : lo + n] = v
        ctx = lo + n
        keys = st.k[:ctx].transpose(0, 1).unsqueeze(0)
        vals = st.v[:ctx].transpose(0, 1).unsqueeze(0)
        mask = None
        if n > 1:
            mask = torch.arange(ctx).view(1, ctx) <= (torch.arange(n) + lo).view(n, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, vals, attn_mask=mask,
                                           enable_gqa=c.num_heads != c.num_kv_heads)
        return o[0].transpose(0, 1).reshape(n, c.num_heads * c.head_dim)

    def _run(self, items: list[tuple[_HeadState, torch.Tensor, torch.Tensor, int]]) -> torch.Tensor:
        """items: (state, token ids [n], features [n, hidden], first position). Returns each item's
        last predicted feature, [len(items), hidden]."""
        head = self.head
        ids = torch.cat([t for _, t, _, _ in items])
        feats = torch.cat([f for _, _, f, _ in items])
        positions = torch.cat([torch.arange(p, p + t.shape[0]) for _, t, _, p in items])
        emb = self.target._embed(ids).to(feats.dtype)
        x, q, k, v = head.qkv(emb, feats, positions)
        outs, last, row = [], [], 0
        for st, t, _, p in items:
            n = t.shape[0]
            outs.append(self._attend(st, q[row : row + n], k[row : row + n], v[row : row + n], p))
            row += n
            last.append(row - 1)
        pred = head.finish(x, torch.cat(outs))
        return pred[torch.tensor(last)]

    def _catch_up(self, req: Request) -> tuple[_HeadState, torch.Tensor, torch.Tensor, int] | None:
        """The head's entries still to make from the target's features, up to the newest real token."""
        st = self.states.get(req.request_id)
        if st is None or st.feats is None:
            return None
        upto = req.num_computed_tokens  # features exist for positions < upto; entry upto-1 reads token upto
        have = min(st.feat_pos + st.feats.shape[0], upto)
        if st.cached > upto:
            st.cached = upto
        if st.cached < st.feat_pos or st.cached < st.first:  # a gap: restart the head's cache here
            if have <= st.feat_pos:
                return None
            st.first = st.cached = st.feat_pos
        if have < upto:  # the newest features are missing (should not happen): nothing to draft from
            return None
        lo = st.cached
        if lo >= upto:  # caught up already (no new feature since the last proposal)
            return None
        tokens = req.all_token_ids()
        ids = torch.tensor(tokens[lo + 1 : upto + 1], dtype=torch.long)
        feats = st.feats[lo - st.feat_pos : upto - st.feat_pos]
        st.cached = upto
        st.feats, st.feat_pos = st.feats[upto - st.feat_pos :], upto
        return st, ids, feats, lo

    # ------------------------------------------------------------ proposing
    def _draft_tokens(self, pred: torch.Tensor, active: list[tuple[Request, int]],
                      rows: dict[str, list[torch.Tensor]]) -> list[int]:
        """One draft token per active request from the head's predicted features."""
        small = self.head.logits(pred).float()
        tokens: list[int | None] = [None] * len(active)
        full_rows = []
        for i, (r, _) in enumerate(active):
            if r.params.greedy and not self.sampler.changes_logits(r):  # the head's own argmax is the draft
                tokens[i] = int(self.head.token_map[int(small[i].argmax())])
            else:
                full_rows.append(i)
        if full_rows:
            full = torch.full((len(full_rows), self.vocab_size), float("-inf"))
            full[:, self.head.token_map] = small[torch.tensor(full_rows)]
            views = [proposal_view(active[i][0]) for i in full_rows]
            processed = self.sampler.process(full, views)
            for j, i in enumerate(full_rows):
                r = active[i][0]
                tokens[i] = draw_draft(self.sampler, processed[j], views[j], r, rows[r.request_id])
        return [int(t) for t in tokens]

    @torch.inference_mode()
    def propose_batch(self, reqs: list[Request], ks: list[int]) -> None:
        items, active = [], []
        for r, k in zip(reqs, ks, strict=True):
            r.spec_token_ids, r.spec_probs = [], None
            if k <= 0:
                continue
            item = self._catch_up(r)
            if item is not None:
                items.append(item)
                active.append((r, k))
        if not items:
            return
        pred = self._run(items)
        rows: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _ in active}
        states = [it[0] for it in items]
        positions = [r.num_computed_tokens for r, _ in active]  # where each request's next entry goes
        while active:
            nxt, keep = [], []
            for i, tok in enumerate(self._draft_tokens(pred, active, rows)):
                r, k = active[i]
                r.spec_token_ids.append(tok)
                if len(r.spec_token_ids) < k:
                    keep.append(i)
                    nxt.append((states[i], torch.tensor([tok]), pred[i : i + 1], positions[i]))
            if not keep:
                break
            pred = self._run(nxt)
            active = [active[i] for i in keep]
            states = [states[i] for i in keep]
            positions = [positions[i] + 1 for i in keep]
        for r in reqs:
            qs = rows.get(r.request_id)
            if qs and not r.params.greedy:
                r.spec_probs = torch.stack(qs)
