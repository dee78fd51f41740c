"""LLMEngine: one step = schedule -> run the model -> sample -> update requests -> outputs."""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass

import torch

from hasten.config import EngineConfig
from hasten.engine.detokenizer import IncrementalDetokenizer
from hasten.engine.kv_cache import KVCacheManager
from hasten.engine.model_runner import ModelRunner
from hasten.engine.request import Request
from hasten.engine.sampler import Sampler, prompt_logprobs_for
from hasten.engine.scheduler import Scheduler, SchedulerConfig
from hasten.engine.spec import DepthController, NgramProposer, SpecStats, verify
from hasten.engine.stats import EngineStats, QueueFullError
from hasten.model.config import ModelConfig
from hasten.model.decoder import Decoder
from hasten.model.dtypes import check_int8_kv_cache, resolve_dtype, resolve_kv_cache_dtype
from hasten.model.layers import resolve_attention_backend
from hasten.model.loader import load_hf_config, load_state_dict, resolve_model
from hasten.outputs import CompletionOutput, RequestOutput
from hasten.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Group:
    """A user request: n sequences sharing one prompt, plus what has been emitted so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Request]
    detoks: list[IncrementalDetokenizer | None]
    emitted_tokens: list[int]
    emitted_logprobs: list[int]
    finished_reported: bool = False
    error: str | None = None  # why the engine failed this request alone (it is then finished)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        t0 = time.time()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        folder = resolve_model(config.model)
        self.model_path = folder
        self.model_name = config.served_model_name or _model_name(config.model, folder)
        hf_cfg = load_hf_config(folder)
        self.model_config = cfg = ModelConfig.from_hf(hf_cfg)
        from hasten.runtime.device import check_device_options, resolve_device, uses_device_path

        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.max_model_len = config.max_model_len or min(cfg.max_position_embeddings, 8192)
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len, policy=config.scheduling_policy,
            max_num_batched_tokens=config.max_num_batched_tokens, decode_defer_ms=config.decode_defer_ms,
            enable_chunked_prefill=config.enable_chunked_prefill)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.eos_token_ids = sorted(set(cfg.eos_token_ids) | ({self.tokenizer.eos_token_id} - {None}))
        from hasten.distributed.launch import parallel_layout

        tp, pp = parallel_layout(config)
        world = tp * pp
        self.attention_backend = resolve_attention_backend(config.attention_backend, self.device)
        self.device_path = uses_device_path(self.device, self.attention_backend)
        check_device_options(config, self.device, self.dtype, self.device_path, world)
        if self.kv_dtype == torch.int8:
            check_int8_kv_cache(config, self.device, self.attention_backend)
        rank_cfg = cfg
        if world > 1:
            from hasten.distributed.launch import local_config

            rank_cfg = local_config(cfg, tp, pp)  # each rank's KV pool holds its heads / layers only
        bs = config.block_size
        self.parallel = None  # the tensor- or pipeline-parallel group (rank 0's handle)
        if world > 1:
            from hasten.distributed.launch import start_rank0

            num_blocks = self._num_blocks(rank_cfg)
            self.parallel, self.model = start_rank0(config, folder, cfg, self.dtype, self.kv_dtype,
                                                    self.max_model_len, num_blocks, self.attention_backend)
            self._finalizer = weakref.finalize(self, self.parallel.close)
        else:
            state = load_state_dict(folder)
            ops = None
            if self.attention_backend == "triton" and config.fused_decoder_ops:
                from hasten.runtime.device import TritonDecoderOps

                ops = TritonDecoderOps()
            self.model = Decoder(
                cfg, state, self.dtype, self.max_model_len, self._linear_factory(folder),
                fused_ops=config.fused_decoder_ops, native_loop=config.native_decoder_loop,
                attention_group=config.attention_prefix_group, device=self.device, ops=ops,
            )
            del state
            if not self.device_path:
                # auto: bfloat16 attention for prefill chunks where the projections took bfloat16 too, int8
                # scores (and bfloat16 P V) over an int8 cache where the kernels have VNNI (and AVX512-BF16)
                self.model.apply_cpu_switches(config)
            num_blocks = self._num_blocks(rank_cfg)
        # every layer's window (under pipeline parallelism rank 0 holds only its stage's layers)
        windows = cfg.windows_within(self.max_model_len)
        # the in-place kernels read only the blocks a window reaches (the sdpa path gathers every block)
        early_free = (config.free_blocks_outside_window and self.attention_backend in ("cpp", "triton")
                      and all(w > 0 for w in windows))
        self.kv = KVCacheManager(num_blocks, bs, config.enable_prefix_caching, max(windows) if early_free else 0)
        self.scheduler = Scheduler(self.scheduler_config, self.kv)
        if self.parallel is not None:
            if pp > 1:
                from hasten.distributed.pipeline import PipelineModelRunner as runner_cls
            else:
                from hasten.distributed.worker import ParallelModelRunner as runner_cls
            self.runner: ModelRunner = runner_cls(self.model, self.parallel, self.model.cfg, num_blocks, bs,
                                                  self.kv_dtype, self.attention_backend)
        elif self.device_path:
            from hasten.runtime.runner import DeviceModelRunner

            graphs = config.cuda_graphs and not config.enforce_eager and self.device.type == "cuda"
            self.runner = DeviceModelRunner(self.model, cfg, num_blocks, bs, self.kv_dtype, self.attention_backend,
                                            self.device, self.max_model_len, "capture" if graphs else "off",
                                            config.cuda_graph_max_batch, config.max_num_seqs)
        else:
            self.runner = ModelRunner(self.model, cfg, num_blocks, bs, self.kv_dtype, self.attention_backend,
                                      huge_pages=config.wants_huge_pages() and self.device.type == "cpu")
        if self.device_path:
            from hasten.runtime.sampler import DeviceSampler

            self.sampler: Sampler = DeviceSampler(cfg.vocab_size, self.device)
        else:
            self.sampler = Sampler(cfg.vocab_size)
        self.sampler.reseed(config.seed)
        self.proposer = self._make_proposer()
        self.hidden_observers: list = []
        if getattr(self.proposer, "wants_hidden", False):
            self.add_hidden_observer(self.proposer)
        self.spec_stats = SpecStats()
        self.depth = DepthController(config.num_speculative_tokens, config.speculative_adaptive)
        self.groups: dict[str, _Group] = {}
        self.seq_to_group: dict[str, _Group] = {}
        capture = getattr(self.runner, "capture_graphs", None)
        if capture is not None:
            capture()  # CUDA graphs are captured before the server reports ready
        self.huge_pages_report = None
        if config.wants_huge_pages() and self.device.type == "cpu":  # rank 0's shard (the other ranks do theirs)
            from hasten.runtime.huge_pages import collapse_engine_memory

            self.huge_pages_report = collapse_engine_memory(self.model, self.runner)
        self.load_time = time.time() - t0
        logger.info("loaded %s (%s on %s, %s attention) in %.2fs: %d KV blocks of %d tokens = %d tokens",
                    self.model_name, self.dtype, self.device, self.attention_backend, self.load_time, num_blocks, bs,
                    num_blocks * bs)

    def _num_blocks(self, rank_cfg: ModelConfig) -> int:
        """The KV pool's blocks: num_kv_blocks if given; on CUDA what the memory profile leaves; else
        kv_cache_memory_gb's worth. Must hold one max_model_len sequence."""
        config, bs = self.config, self.config.block_size
        if config.num_kv_blocks:
            num_blocks = config.num_kv_blocks
        elif self.device.type == "cuda":
            from hasten.runtime.memory import plan_kv_cache

            plan = plan_kv_cache(self.model, rank_cfg, config, self.kv_dtype, self.max_model_len, self.device,
                                 self.attention_backend, self.scheduler_config.max_num_batched_tokens)
            logger.info(plan.describe(bs))
            num_blocks = plan.num_blocks
        else:
            num_blocks = ModelRunner.blocks_for_memory(rank_cfg, bs, self.kv_dtype, int(config.kv_cache_memory_gb * 2**30))
        min_blocks = -(-self.max_model_len // bs)
        if num_blocks < min_blocks:
            raise ValueError(
                f"KV cache of {num_blocks} blocks cannot hold one max_model_len={self.max_model_len} sequence "
                f"(needs {min_blocks}); raise kv_cache_memory_gb or lower max_model_len"
            )
        return num_blocks

    def _linear_factory(self, folder):
        if self.device_path:
            if not self.config.quantization:
                from hasten.model.linear import dense_factory

                return dense_factory
            from hasten.quant.factory import linear_factory_for
            from hasten.runtime.quant_linear import DeviceQuantLayers

            return linear_factory_for(self.config, folder, DeviceQuantLayers(self.device, self.dtype))
        from hasten.quant.factory import engine_linear_factory

        return engine_linear_factory(self.config, folder, self.dtype)

    def _make_proposer(self):
        spec = self.config.speculative
        if not spec:
            return None
        if spec == "ngram":
            return NgramProposer(self.config.ngram_min, self.config.ngram_max, self.config.ngram_scaled_depth)
        if spec.startswith("draft:"):
            from hasten.engine.spec.draft import DraftModelProposer

            return DraftModelProposer(spec.split(":", 1)[1], self, self.config.speculative_draft_quantization)
        if spec.startswith("eagle:"):
            from hasten.engine.spec.eagle import EagleProposer

            return EagleProposer(spec.split(":", 1)[1], self)
        if spec.startswith("ngram+eagle:"):
            from hasten.engine.spec.eagle import EagleProposer
            from hasten.engine.spec.hybrid import HybridProposer

            return HybridProposer(EagleProposer(spec.split(":", 1)[1], self), self.config.num_speculative_tokens,
                                  max(2, self.config.ngram_min), self.config.ngram_max, self.config.ngram_scaled_depth)
        raise ValueError(f"unknown speculative method {spec!r}: use 'ngram', 'draft:<model path>', 'eagle:<folder>' "
                         "or 'ngram+eagle:<folder>'")

    # ------------------------------------------------------------ requests in

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if len(self.scheduler.waiting) >= self.config.max_waiting_requests and not request_id.startswith("__"):
            raise QueueFullError(f"too many waiting requests ({len(self.scheduler.waiting)})")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        for name, tok in params.token_ids_out_of_range(vocab):
            raise ValueError(f"{name}: token id {tok} is out of range (vocabulary size {vocab})")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len}")
        if params.max_tokens is None:
            params = params.clone(max_tokens=room)
        elif params.max_tokens > room:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"length {self.max_model_len}"
            )
        arrival = arrival_time or time.time()
        seqs, detoks = [], []
        for i in range(params.n):
            seq_params = params if params.n == 1 or params.seed is None else params.clone(seed=params.seed + i)
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(seq_id, ids, seq_params, self.eos_token_ids, priority, cache_salt, arrival, text, request_id, i)
            seqs.append(req)
            detoks.append(
                IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, params.stop, params.include_stop_str_in_output)
                if params.detokenize else None
            )
        group = _Group(request_id, text, ids, seqs, detoks, [0] * len(seqs), [0] * len(seqs))
        self.groups[request_id] = group
        for req in seqs:
            self.seq_to_group[req.request_id] = group
            self.scheduler.add(req)

    def abort_request(self, request_id: str) -> bool:
        group = self.groups.pop(request_id, None)
        if group is None:
            return False
        for req in group.seqs:
            if not req.is_finished:
                self.scheduler.finish(req, "abort")
                if self.proposer is not None:
                    self.proposer.release(req.request_id)
            self.seq_to_group.pop(req.request_id, None)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def warm_up(self) -> None:
        """A 4-token request of 2 greedy tokens stepped to its end (first-call work before serving)."""
        self.add_request("__warmup__", [self.eos_token_ids[0] if self.eos_token_ids else 0] * 4,
                         SamplingParams(max_tokens=2, ignore_eos=True, temperature=0))
        while self.has_unfinished_requests():
            self.step()
        self.kv.reset_prefix_cache()

    def close(self) -> None:
        """Stop the tensor-parallel ranks (if any) and leave their group; also done at exit."""
        if self.parallel is not None:
            self._finalizer()

    # ------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return self._collect_outputs(set())
        t0 = time.perf_counter()
        result = self.runner.execute(batch)
        if self.runner.keep_hidden:
            self._observe(batch)
        now = time.time()
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            # draft tokens count as computed only once verified
            req.num_computed_tokens += n - len(req.spec_token_ids)
            self.kv.cache_computed_blocks(req)
        touched: set[str] = set()
        for rid, (first_pos, logits) in result.prompt_logits.items():
            req = next(r for r in batch.requests if r.request_id == rid)
            self._isolated(req, touched, self._add_prompt_logprobs, req, first_pos, logits)
        plain, plain_rows, offset = [], [], 0
        for req, rows in zip(result.sample_requests, result.num_rows, strict=True):
            if req.is_finished:
                pass
            elif rows == 1:
                plain.append(req)
                plain_rows.append(offset)
            else:
                self._isolated(req, touched, self._verify, req, result.logits[offset : offset + rows], now)
            offset += rows
        if plain:
            logits = result.logits if len(plain_rows) == offset else result.logits[torch.tensor(plain_rows)]
            for req, tok, lp in zip(plain, *self._sample(logits, plain, touched), strict=True):
                if tok is not None and not req.is_finished:
                    self._isolated(req, touched, self._append_token, req, tok, lp, now)
        if self.proposer is not None:
            self.depth.record_step(batch.total_tokens, time.perf_counter() - t0)
            self._propose()
        return self._collect_outputs(touched)

    # ------------------------------------------------------------ per-request failure isolation

    def _isolated(self, req: Request, touched: set[str], fn, *args) -> None:
        """Run one request's part of the step; an exception fails that request alone."""
        touched.add(req.parent_id or req.request_id)
        try:
            fn(*args)
        except Exception as exc:
            self._fail_request(req, exc)

    def _sample(self, logits: torch.Tensor, reqs: list[Request], touched: set[str]):
        """The batched sampler; if it raises, each row again on its own, so that only the rows that
        fail again lose their request (their token is None)."""
        try:
            return self.sampler.sample(logits, reqs)
        except Exception:
            logger.warning("batched sampling failed; sampling the %d rows one by one", len(reqs))
        tokens: list[int | None] = []
        lps: list = []
        for i, req in enumerate(reqs):
            try:
                tok, lp = self.sampler.sample(logits[i : i + 1], [req])
            except Exception as exc:
                touched.add(req.parent_id or req.request_id)
                self._fail_request(req, exc)
                tok, lp = [None], [None]
            tokens.extend(tok)
            lps.extend(lp)
        return tokens, lps

    def _fail_request(self, req: Request, exc: BaseException) -> None:
        """End the user request that ``req`` belongs to (all its sequences) with an error."""
        rid = req.parent_id or req.request_id
        logger.error("request %s failed in the engine; the step goes on for the others", rid,
                     exc_info=(type(exc), exc, exc.__traceback__))
        group = self.seq_to_group.get(req.request_id) or self.groups.get(rid)
        seqs = group.seqs if group is not None else [req]
        if group is not None and group.error is None:
            group.error = f"{type(exc).__name__}: {exc}"
        for seq in seqs:
            if not seq.is_finished:
                seq.finish_reason = "error"
                self.scheduler.finish(seq, "error")
                if self.proposer is not None:
                    self.proposer.release(seq.request_id)

    def _add_prompt_logprobs(self, req: Request, first_pos: int, logits: torch.Tensor) -> None:
        k = req.params.prompt_logprobs or 0
        nxt = [req.token_at(p + 1) for p in range(first_pos, first_pos + logits.shape[0])]
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None]
        req.prompt_logprobs.extend(prompt_logprobs_for(logits, nxt, k))

    # ------------------------------------------------------------ speculative decoding

    def _verify(self, req: Request, rows: torch.Tensor, now: float) -> None:
        drafts = req.spec_token_ids
        tokens, lps, accepted = verify(self.sampler, req, rows, drafts, req.spec_probs)
        k = len(drafts)
        st = self.spec_stats
        st.proposed += k
        st.accepted += accepted
        st.emitted += len(tokens)
        st.steps += 1
        observed = accepted / (accepted + (1 if accepted < k else 0))
        req.spec_acceptance = 0.8 * req.spec_acceptance + 0.2 * observed
        req.spec_token_ids = []
        req.spec_probs = None
        for tok, lp in zip(tokens, lps, strict=True):
            self._append_token(req, tok, lp, now)
            if req.is_finished:
                return
        req.num_computed_tokens += accepted  # the accepted drafts' K/V are already in the cache
        self.kv.cache_computed_blocks(req)
        self.kv.trim(req, req.num_tokens)

    def add_hidden_observer(self, observer) -> None:
        """After every step, observer.observe(batch, hidden): the final hidden state of each token the
        step computed, in batch order, before num_computed_tokens moves on (an EAGLE proposer drafts
        from them; `hasten distill draft` records them)."""
        self.hidden_observers.append(observer)
        self.runner.keep_hidden = True

    def remove_hidden_observer(self, observer) -> None:
        self.hidden_observers.remove(observer)
        self.runner.keep_hidden = bool(self.hidden_observers)

    def _observe(self, batch) -> None:
        """Hand the step's final hidden states to the observers. A failure there costs that observer
        its state for these requests (speculation starts over), never a request."""
        for observer in self.hidden_observers:
            try:
                observer.observe(batch, self.runner.last_hidden)
            except Exception:
                logger.exception("%s could not take the step's hidden states; its state is reset",
                                 type(observer).__name__)
                for req in batch.requests:
                    observer.release(req.request_id)
        self.runner.last_hidden = None

    def _propose(self) -> None:
        """Attach draft tokens to decoding requests for the next step."""
        cands = [
            r for r in self.scheduler.running
            if r.num_computed_tokens == r.num_tokens - 1 and not r.params.logits_processors and r.output_token_ids
        ]
        if not cands:
            return
        others = len(self.scheduler.running) - len(cands)
        plan = getattr(self.proposer, "plan", None)  # a proposer with a choice of drafter per request
        if plan is not None:
            plan(cands)
        k = self.depth.choose([r.spec_acceptance for r in cands], others)
        if k == 0:
            for r in cands:  # drift slowly back toward the prior so speculation can come back
                r.spec_acceptance = 0.98 * r.spec_acceptance + 0.02 * 0.7
            return
        wants = []
        for r in cands:
            room = min(r.params.max_tokens - r.num_output_tokens, self.max_model_len - r.num_tokens) - 1
            wants.append(min(k, room))
        t0 = time.perf_counter()
        self.proposer.propose_batch(cands, wants)
        self.depth.record_proposal(sum(len(r.spec_token_ids) for r in cands), time.perf_counter() - t0)

    def _append_token(self, req: Request, tok: int, lp, now: float) -> None:
        req.output_token_ids.append(tok)
        m = req.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        m.token_times.append(now)
        if lp is not None and req.logprobs is not None:
            req.logprobs.append(lp)
            req.cumulative_logprob += lp[tok]
        group = self.seq_to_group[req.request_id]
        detok = group.detoks[req.index]
        stop_str = None
        if detok is not None:
            stop_str = detok.add_token(tok)
        p = req.params
        reason, stop_reason = None, None
        if not p.ignore_eos and tok in req.eos_token_ids:
            reason = "stop"
        elif tok in p.stop_token_ids:
            reason, stop_reason = "stop", tok
        elif stop_str is not None:
            reason, stop_reason = "stop", stop_str
        elif req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            if detok is not None and stop_str is None:
                detok.flush()
            req.finish_reason, req.stop_reason = reason, stop_reason
            self.scheduler.finish(req, reason)
            if self.proposer is not None:
                self.proposer.release(req.request_id)

    def _collect_outputs(self, touched: set[str]) -> list[RequestOutput]:
        outs = []
        for rid in touched:
            group = self.groups.get(rid)
            if group is None:
                continue
            try:
                out = self._make_output(group)
            except Exception as exc:  # e.g. the detokenizer: this request alone fails
                self._fail_request(group.seqs[0], exc)
                out = RequestOutput(rid, group.prompt, group.prompt_token_ids, [], True, error=group.error)
            if out.finished:
                self.groups.pop(rid, None)
                for req in group.seqs:
                    self.seq_to_group.pop(req.request_id, None)
            outs.append(out)
        return outs

    def _make_output(self, group: _Group) -> RequestOutput:
        completions = []
        for i, req in enumerate(group.seqs):
            detok = group.detoks[i]
            done = req.is_finished
            text = detok.text if detok else ""
            delta = detok.take_delta(done) if detok else ""
            new_ids = req.output_token_ids[group.emitted_tokens[i] :]
            group.emitted_tokens[i] = req.num_output_tokens
            delta_lp = None
            if req.logprobs is not None:
                delta_lp = req.logprobs[group.emitted_logprobs[i] :]
                group.emitted_logprobs[i] = len(req.logprobs)
            completions.append(
                CompletionOutput(
                    index=i,
                    text=text if done else text[: detok.emitted] if detok else "",
                    token_ids=list(req.output_token_ids),
                    cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
                    logprobs=list(req.logprobs) if req.logprobs is not None else None,
                    finish_reason=req.finish_reason if done else None,
                    stop_reason=req.stop_reason,
                    delta_text=delta,
                    delta_token_ids=new_ids,
                    delta_logprobs=delta_lp,
                )
            )
        finished = all(r.is_finished for r in group.seqs)
        first = group.seqs[0]
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=first.prompt_logprobs,
            metrics=first.metrics,
            num_cached_tokens=first.metrics.num_cached_tokens,
            error=group.error,
        )

    # ------------------------------------------------------------ introspection

    def get_stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage,
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.pool.num_blocks,
            prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
            spec_proposer=self.proposer.name if self.proposer is not None else None,
            spec_proposed_tokens=self.spec_stats.proposed,
            spec_accepted_tokens=self.spec_stats.accepted,
            spec_emitted_tokens=self.spec_stats.emitted,
        )


def _model_name(model: str | None, folder) -> str:
    if model is None:
        from hasten.model.loader import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    from pathlib import Path

    from hasten.model.loader import looks_like_hub_id

    p = Path(model)
    if not p.exists() and looks_like_hub_id(model):
        return model  # a Hub id, served under the name it was asked for
    return p.stem if p.suffix == ".gguf" else p.name
