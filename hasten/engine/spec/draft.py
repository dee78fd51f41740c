"""Draft-model proposer: a smaller (or quantized) model with the same tokenizer guesses k tokens.

The draft keeps its own paged KV cache under the same block-pool rules as the target. For each
target request it holds a shadow `Request` whose tokens are the target's real tokens plus the
drafts it proposed; after verification the shadow is cut back to the longest prefix it shares
with the target, so only the tokens that differ are recomputed. Drafts are sampled from the
draft's distribution after the target request's own temperature / top-k / top-p / penalties,
and those proposal rows (q) go to the verifier.
"""

from __future__ import annotations

import torch

from hasten.engine.kv_cache import KVCacheManager
from hasten.engine.model_runner import ModelRunner
from hasten.engine.request import Request
from hasten.engine.scheduler import ScheduledBatch
from hasten.model.config import ModelConfig
from hasten.model.decoder import Decoder
from hasten.model.loader import load_hf_config, load_state_dict, resolve_model
from hasten.sampling_params import SamplingParams


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def proposal_view(req: Request) -> Request:
    """The request as a proposer samples for it: its outputs followed by the drafts made so far."""
    view = Request(req.request_id, req.prompt_token_ids, req.params, req.eos_token_ids)
    view.output_token_ids = req.output_token_ids + req.spec_token_ids
    return view


def draw_draft(sampler, processed: torch.Tensor, view: Request, req: Request, qs: list[torch.Tensor]) -> int:
    """One draft token from a processed logits row [V]: its argmax for greedy requests, else a draw
    from the request's distribution q (temperature, top-k/top-p), which is kept in `qs` for the
    verifier."""
    if req.params.greedy:
        return int(processed.argmax())
    q = sampler.probs(processed[None], [view])[0]
    qs.append(q)
    return int((q / sampler.noise_for(req, q.shape).clamp_(min=1e-30)).argmax())


class DraftModelProposer:
    name = "draft"

    def __init__(self, model: str, engine, quantization: str | None = None):
        folder = resolve_model(model)
        cfg = ModelConfig.from_hf(load_hf_config(folder))
        target = engine.model_config
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft model vocab ({cfg.vocab_size}) differs from the target's ({target.vocab_size}): "
                "the draft must share the target's tokenizer"
            )
        factory = None
        if quantization:
            from hasten.quant import linear_factory_for

            factory = linear_factory_for(engine.config.clone(quantization=quantization), folder)
        self.model = Decoder(
            cfg, load_state_dict(folder), engine.dtype, engine.max_model_len, factory,
            fused_ops=engine.config.fused_decoder_ops, native_loop=engine.config.native_decoder_loop,
        )
        bs = engine.config.block_size
        num_blocks = engine.kv.pool.num_blocks
        self.kv = KVCacheManager(num_blocks, bs, engine.config.enable_prefix_caching)
        self.runner = ModelRunner(self.model, cfg, num_blocks, bs, engine.kv_dtype, engine.attention_backend)
        self.sampler = engine.sampler
        self.shadows: dict[str, Request] = {}
        self.name = f"draft:{folder.name}"

    def _shadow(self, req: Request) -> Request:
        real = req.all_token_ids()
        sh = self.shadows.get(req.request_id)
        if sh is None:
            sh = Request(req.request_id, real, SamplingParams(max_tokens=1), [], cache_salt=req.cache_salt)
            self.shadows[req.request_id] = sh
            found = self.kv.find_cached_prefix(sh)
            if found and self.kv.allocate(sh, 0, found):
                sh.num_computed_tokens = len(found) * self.kv.block_size
            return sh
        fed = sh.all_token_ids()
        keep = min(_common_prefix(fed, real), sh.num_computed_tokens)
        sh.prompt_token_ids, sh.output_token_ids = real, []
        sh.num_computed_tokens = keep
        sh.block_hashes = sh.block_hashes[: keep // self.kv.block_size]
        sh.num_cached_blocks = min(sh.num_cached_blocks, keep // self.kv.block_size)
        self.kv.trim(sh, keep)
        return sh

    def release(self, request_id: str) -> None:
        """The target request is finished or aborted: free its shadow's draft KV blocks."""
        sh = self.shadows.pop(request_id, None)
        if sh is not None:
            self.kv.free(sh)

    @torch.inference_mode()
    def propose_batch(self, reqs: list[Request], ks: list[int]) -> None:
        active: list[tuple[Request, Request, int]] = []
        for r, k in zip(reqs, ks, strict=True):
            r.spec_token_ids, r.spec_probs = [], None
            if k > 0:
                active.append((r, self._shadow(r), k))
        rows: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _, _ in active}
        step = 0
        while active:
            batch = ScheduledBatch()
            for _, sh, _ in active:
                n = sh.num_tokens - sh.num_computed_tokens
                if self.kv.allocate(sh, n):
                    batch.requests.append(sh)
                    batch.num_new_tokens.append(n)
            if not batch:
                break
            result = self.runner.execute(batch)
            for sh, n in zip(batch.requests, batch.num_new_tokens, strict=True):
                sh.num_computed_tokens += n
                self.kv.cache_computed_blocks(sh)
            by_id = {sh.request_id: i for i, sh in enumerate(result.sample_requests)}
            still = []
            targets = [(r, sh, k) for r, sh, k in active if sh.request_id in by_id]
            if targets:
                views = [proposal_view(r) for r, _, _ in targets]
                logits = result.logits[torch.tensor([by_id[sh.request_id] for _, sh, _ in targets])]
                processed = self.sampler.process(logits, views)
                for i, (r, sh, k) in enumerate(targets):
                    tok = draw_draft(self.sampler, processed[i], views[i], r, rows[r.request_id])
                    r.spec_token_ids.append(tok)
                    if len(r.spec_token_ids) < k:
                        sh.output_token_ids.append(tok)
                        still.append((r, sh, k))
            active = still
            step += 1
        for r in reqs:
            qs = rows.get(r.request_id)
            if qs and not r.params.greedy:
                r.spec_probs = torch.stack(qs)
