"""EngineConfig: every speed feature is a named switch with a default, so benchmarks can flip them."""

from __future__ import annotations

import ast
from dataclasses import dataclass, fields
from typing import Any


@dataclass
class EngineConfig:
    model: str | None = None  # HF folder or .gguf file; None = the embedded SmolLM2-135M-Instruct
    served_model_name: str | None = None
    dtype: str = "auto"  # auto (= float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16 (not on the C++ path)
    # where the weights, the KV pool and each step's tensors live: cpu | cuda | cuda:N (hasten/runtime)
    device: str = "cpu"
    gpu_memory_utilization: float = 0.9  # CUDA: the share of the device's memory for weights, activations and KV pool
    cuda_graphs: bool = True  # CUDA: decode steps replayed from CUDA graphs at bucketed batch sizes
    enforce_eager: bool = False  # CUDA: no CUDA graphs (the same as cuda_graphs=False)
    cuda_graph_max_batch: int = 256  # CUDA: the largest decode batch with a graph (buckets 1, 2, 4, 8, 16, 24, ...)
    max_model_len: int | None = None  # default: min(model context, 8192)
    # KV cache
    block_size: int = 16
    # auto (= the model dtype) | float32 | float16 | bfloat16 (half the bytes per token) | int8 (each head's row
    # of each token as int8 codes and an absmax scale: ~0.27x float32's bytes; C++ attention on the CPU only)
    kv_cache_dtype: str = "auto"
    kv_cache_memory_gb: float = 1.0
    num_kv_blocks: int | None = None  # overrides kv_cache_memory_gb
    enable_prefix_caching: bool = True
    # sliding-window models (every layer windowed, C++ attention): release a request's blocks that no
    # layer's window reaches any more, so long sequences hold about window / block_size blocks
    free_blocks_outside_window: bool = True
    # scheduling
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # per-step token budget
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"  # fcfs | priority
    # while prompts wait or are part-way through prefill, a decoding request whose last token came less
    # than this many ms ago sits a step out, leaving the step's rows to prefill (decode rows cost ~4 prefill
    # rows each on the CPU: attention over their whole context, lm_head, sampling); 0 = never
    decode_defer_ms: float = 0.0
    max_waiting_requests: int = 4096  # beyond this new requests are refused (HTTP 429)
    # speculative decoding
    # None | "ngram" | "draft:<model path>" | "eagle:<head folder>" (hasten distill draft) | "ngram+eagle:<head folder>"
    # (prompt lookup after a match of max(2, ngram_min) tokens or more, the head elsewhere: spec/hybrid.py)
    speculative: str | None = None
    # quantize the draft model (e.g. "int4"); an EAGLE head: int8 unless "none"
    speculative_draft_quantization: str | None = None
    num_speculative_tokens: int = 4  # the most draft tokens verified per request per step
    speculative_adaptive: bool = True  # pick the depth per step from acceptance rates and step costs
    ngram_min: int = 1
    ngram_max: int = 8
    ngram_scaled_depth: bool = True  # fewer drafts after 1- and 2-token matches (spec/ngram.py)
    # model execution
    quantization: str | None = None  # None | int8 | int4 | gguf (weight-only; see hasten.quant)
    # quantization options (also quantization="gguf": serve the GGUF's own Q4_0/Q4_1/Q4_K/Q5_*/Q6_K/Q8_0 blocks)
    quant_method: str = "rtn"  # int4 recipe: rtn (round-to-nearest) | awq (activation-aware scales)
    quant_group_size: int = 32  # int4 group: 32 | 64 | 128 (a layer whose K it does not divide uses a smaller one)
    quant_symmetric: bool = False  # int4: symmetric (zero point 8) or asymmetric (per-group min)
    quantize_lm_head: bool = True  # False keeps lm_head in the engine dtype
    quant_cache_dir: str | None = None  # where quantized weights are saved; None = <hasten cache>/quant
    quant_int4_kernel: str = "auto"  # auto | hasten (C++ AVX2, float32 activations) | torch (aten, bf16 activations)
    quant_int8_kernel: str = "auto"  # auto | hasten (C++, float32 x, exact) | hasten-q8 (int8 x) | torch (aten, bf16 x); auto = hasten, GGUF Q8_0: hasten-q8
    quant_q8_gemm: bool = True  # int8-activation int4 layers: 2+ rows in int8 too (u8 x s8 GEMM; False: float32 GEMM)
    # one row of x (batch-1 decode) on that GEMM's tiles too instead of the one-row dot-product kernel:
    # auto = on where the tiles lack VNNI (plain AVX2) | on | off
    quant_q8_gemm_one_row: str = "auto"
    # AVX-512 VNNI: from this many rows of x (prefill chunks, decode batches) the int8-activation GEMMs
    # take 16 weight rows per register and up to 8 rows of x per tile (0: the 8-row tiles throughout)
    quant_q8_gemm_wide_rows: int = 8
    # the 8-row tiles of those GEMMs take x in panels of this many bytes of int8 rows, each held in L1 while
    # every block of a task passes over it (0: all rows at once, x streaming past each block)
    quant_q8_gemm_x_panel: int = 16384
    quant_kernel_max_rows: int = 32  # rows (tokens) up to which the packed kernels run; above: dequant + GEMM
    # wide calls (prefill chunks, big decode batches) in bfloat16 against a bfloat16 copy of each quantized
    # weight (+2 bytes per weight): auto = on where the CPU has AMX tiles | on | off
    quant_bf16_gemm: str = "auto"
    quant_bf16_gemm_min_rows: int = 32  # rows of x from which a quantized layer takes the bfloat16 path
    # those calls on hasten's AMX tile kernel over a copy kept in tile order (bf16_tiles_linear) where the
    # build, CPU and shape allow; False: oneDNN's GEMM over a row-major copy (reordered on every call)
    quant_bf16_gemm_tiles: bool = True
    # that kernel's x copied in tile order (each tile one contiguous 1 KB run, not 16 lines K * 2 bytes apart)
    # and each thread's next weight blocks requested into L2 a few lines per k step while the current ones
    # run; in the C++ layer loop gate_up's SiLU-multiply output goes to down already rounded to bfloat16 in
    # that order (bf16_tiles_linear's stream, bf16_tiles_linear_silu's tiles_out: the same outputs); False: x
    # row-major and converted per call, nothing requested ahead
    quant_bf16_gemm_stream: bool = True
    # the C++ layer loop's gate_up calls on that kernel apply SiLU-multiply to their own output tiles
    # (bf16_tiles_linear_silu: the same values, without writing and re-reading [rows, 2 x intermediate])
    quant_bf16_gemm_silu: bool = True
    # wide calls of 4-bit int8-activation layers (GGUF Q4 blocks) over an 8-bit-per-row copy of each
    # weight (+1 byte per weight; u8_linear_q8_gemm, no nibble unpacking or per-32 weight scales), where
    # the bfloat16 path does not take them: auto = on where the kernels have its AVX-512 VNNI tiles | on | off
    quant_u8_gemm: str = "auto"
    quant_u8_gemm_min_rows: int = 16
    # up to this many consecutive 32-runs of x share one int8 scale in those calls (1 .. 8; 1: per 32 values
    # as every other int8-activation kernel): fewer int-to-float conversions and multiply-adds per weight
    quant_u8_gemm_x_runs: int = 1
    # each int8 scale of x in those calls rounded up to a power of two (the codes then span 64 .. 127
    # instead of 127), so that the kernel applies it as an exponent shift off the VNNI pipes
    quant_u8_gemm_pow2_x_scales: bool = False
    # the C++ layer loop's gate_up calls on that kernel apply SiLU-multiply to their own output tiles
    # (u8_linear_q8_gemm_silu: the same values, without writing and re-reading [rows, 2 x intermediate])
    quant_u8_gemm_silu: bool = True
    # and the C++ layer loop's gate_up calls on the int4 int8-activation GEMM (the 8-row tiles: AVX2 builds,
    # and AVX-512 ones below their two-block tiles' rows), int4_linear_q8_gemm_silu: the same values
    quant_int4_gemm_silu: bool = True
    # SiLU-multiply with a vectorized exp (~2 ulp) where the down projection rounds its input anyway
    # (int8 / bfloat16 activations); float32-exact layers keep the exact exp
    fast_silu: bool = True
    fused_decoder_ops: bool = True  # norms, RoPE + cache write, SiLU-mul as C++ ops (PyTorch ops if False/unbuildable)
    native_decoder_loop: bool = True  # float32 + fused ops + cpp attention: the layer loop itself in C++ (bit-identical)
    # auto (cpp on the CPU, triton on CUDA) | cpp (C++ kernel over the block pool in place) | sdpa (gather + SDPA)
    # | triton (the GPU path: Triton attention and fused ops; on the CPU only under TRITON_INTERPRET=1)
    attention_backend: str = "auto"
    attention_prefix_group: int = 8  # cpp: up to N decode sequences read their shared prefix blocks once (<2: off)
    # cpp: a sequence with this many new tokens (a prefill chunk) attends in bfloat16 SDPA over its gathered
    # keys/values: auto = on for quantized models where the CPU has AMX tiles (float32 models stay exact) | on | off
    attention_bf16: str = "auto"
    attention_bf16_min_rows: int = 32
    # cpp, int8 KV cache: a sequence with this many new tokens has q rounded to int8 and its scores taken as
    # integer dot products with the cache's key codes on AVX-512 VNNI: auto = on for an int8 cache where the
    # kernels have the VNNI path | on (an error where they do not) | off
    attention_int8_scores: str = "auto"
    attention_int8_scores_min_rows: int = 16
    # with attention_int8_scores: those sequences' softmax weights (times the value scales) rounded to bfloat16
    # and P V taken as bfloat16 dot products with the value codes: auto = on where the kernels have the
    # AVX512-BF16 path | on (an error where they do not) | off
    attention_bf16_pv: str = "auto"
    # with attention_bf16_pv: those sequences' scores and P V on AMX tiles (TDPBUSD, TDPBF16PS; the same
    # scores and bfloat16 weights): auto = on where the CPU has AMX-INT8 and AMX-BF16 | on (an error where it
    # has not) | off
    attention_amx: str = "auto"
    # cpp, int8 KV cache: the other sequences (decodes, chunks under attention_int8_scores_min_rows) have q
    # rounded to int8 the same way and score against the key codes read in place from the pool (AVX-512 VNNI,
    # or AVX2 + FMA): auto = on for an int8 cache where the kernels have the path | on (an error where they
    # do not) | off
    attention_int8_decode: str = "auto"
    # cpp, int8 / float16 / bfloat16 KV cache: tiles of this many new tokens or more (prefill chunks) transpose
    # their query rows into the vector lanes and widen each block of keys and values once for the whole tile
    # (attention_lane_tiles.h): auto = on where the kernels lack the AVX-512 VNNI attention paths (AVX2 CPUs)
    # | on | off; a float32 cache always keeps its exact path
    attention_lane_tiles: str = "auto"
    attention_lane_tiles_min_tokens: int = 4
    # cpp attention walking a sequence's cache blocks: the block two ahead is requested a few lines per step
    # of the score and value loops; False: all its lines at once when the walk starts a block
    attention_spread_prefetch: bool = True
    # cpp attention: in a step without prompt logprobs or hidden-state readers, the last layer writes every
    # row's keys and values but runs attention, o_proj and the MLP only for the rows whose logits are sampled
    last_layer_sampled_rows: bool = True
    cpu_linear_backend: str = "auto"  # auto (= onednn when available) | hasten (C++ register tiles) | onednn (pre-packed) | torch
    num_threads: int | None = None  # torch intra-op threads (per rank); None = torch's default (TP: cores / ranks)
    # tensor parallelism (hasten/distributed): heads, MLP rows and vocabulary split over this many ranks
    tensor_parallel_size: int = 1
    # pipeline parallelism: the layers split into this many stages, micro-batches in flight (combines with TP)
    pipeline_parallel_size: int = 1
    distributed_timeout_s: float = 300.0  # rendezvous and in-step collectives: a rank silent this long fails the engine
    seed: int = 0  # seed of the sampler for requests that bring none
    # after start-up (weights loaded, warm-up step run) the engine's process moves everything allocated so
    # far out of the cyclic collector's scans (gc.freeze): a full collection under load then walks only
    # per-request objects instead of the whole heap (~330k objects, ~170 ms on 2 Zen 4 cores for the
    # default GGUF; benchmarks/gc_pause.py). Applies to processes hasten owns (the engine process of
    # `hasten serve`, its server process), never to a process that embeds the LLM class
    gc_freeze: bool = True
    # CPU engines: once loaded, the weights (and the kernels' copies of them) and the KV pool are rebuilt in
    # 2 MB pages (MADV_COLLAPSE; the pool asks for them before it is zeroed), so that a step's streams
    # of weights and scattered cache blocks need a few hundred TLB entries instead of ~100k (Linux 6.1+;
    # elsewhere, or where the kernel refuses, the memory stays in 4 KB pages). Never changes results.
    # auto = on for quantized weights (measured faster there), off for float models (their oneDNN-packed
    # weights stay out of reach, and batch-1 decode measured 2-10 % slower) | on | off (or true / false)
    huge_pages: str = "auto"

    def wants_huge_pages(self) -> bool:
        """huge_pages resolved: on, or auto with quantized weights."""
        return self.huge_pages == "on" or (self.huge_pages == "auto" and self.quantization is not None)

    def __post_init__(self) -> None:
        """Sizes and counts out of range are refused here, before a model loads, with the option's name
        (they failed later with a ZeroDivisionError or a tensor error, or refused every request)."""
        for name in ("block_size", "max_waiting_requests"):
            check_positive_int(name, getattr(self, name))
        for name in ("max_model_len", "num_kv_blocks", "num_threads"):
            check_positive_int(name, getattr(self, name), optional=True)
        for name, high in (("kv_cache_memory_gb", float("inf")), ("gpu_memory_utilization", 1.0),
                           ("distributed_timeout_s", float("inf"))):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= high:
                raise ValueError(f"{name} must be a number in (0, {high:g}], not {value!r}")
        # counts and row thresholds (checked here whatever the model and CPU, not only where they apply)
        for name, low, high in _INT_RANGES:
            check_int_range(name, getattr(self, name), low, high)
        self.huge_pages = _auto_switch("huge_pages", self.huge_pages)
        if self.ngram_max < self.ngram_min:
            raise ValueError(f"ngram_max ({self.ngram_max}) must not be below ngram_min ({self.ngram_min})")

    def clone(self, **changes) -> EngineConfig:
        from dataclasses import replace

        return replace(self, **changes)

    @classmethod
    def from_options(cls, **options) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**switches_as_bools(options))


_INT_RANGES: tuple[tuple[str, int, int | None], ...] = (  # (option, lowest, highest or None)
    ("num_speculative_tokens", 1, None), ("ngram_min", 1, None), ("ngram_max", 1, None),
    ("cuda_graph_max_batch", 1, None), ("tensor_parallel_size", 1, None), ("pipeline_parallel_size", 1, None),
    ("quant_group_size", 1, None), ("quant_kernel_max_rows", 0, None), ("quant_q8_gemm_wide_rows", 0, None),
    ("quant_q8_gemm_x_panel", 0, None), ("quant_bf16_gemm_min_rows", 1, None), ("quant_u8_gemm_min_rows", 1, None),
    ("quant_u8_gemm_x_runs", 1, 8), ("attention_prefix_group", 0, None), ("attention_bf16_min_rows", 1, None),
    ("attention_int8_scores_min_rows", 2, None), ("attention_lane_tiles_min_tokens", 1, None),
    ("seed", -(2**63), 2**64 - 1),
)


def check_int_range(name: str, value: Any, low: int, high: int | None = None) -> None:
    """ValueError naming `name` unless value is an int (not a bool) in [low, high] (high None: no bound)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {bound}, not {value!r}")


def check_positive_int(name: str, value: Any, optional: bool = False) -> None:
    """ValueError naming `name` unless value is an int >= 1 (a bool is not one), or None where optional."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer{' or None' if optional else ''}, not {value!r}")


_SWITCH_WORDS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


def as_switch(name: str, value: Any) -> bool:
    """A boolean engine option from a bool, 0 / 1, or one of true/false, yes/no, on/off (any case): a
    string such as "false" must not switch a feature on by being non-empty. TypeError otherwise."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _SWITCH_WORDS:
        return _SWITCH_WORDS[value.strip().lower()]
    raise TypeError(f"{name} must be True or False, not {value!r}")


def _auto_switch(name: str, value: Any) -> str:
    """'auto', 'on' or 'off' from 'auto' or any spelling as_switch takes; TypeError otherwise."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return "on" if as_switch(name, value) else "off"
    except TypeError:
        raise TypeError(f"{name} must be auto, on or off, not {value!r}") from None


def switches_as_bools(options: dict[str, Any]) -> dict[str, Any]:
    """options with every boolean EngineConfig option given as a bool (as_switch); TypeError on any
    other value of one. The other options pass through unchanged."""
    switches = {f.name for f in fields(EngineConfig) if f.type in ("bool", bool)}
    return {k: as_switch(k, v) if k in switches else v for k, v in options.items()}


def parse_option_pairs(items: list[str], flag: str = "--engine-option") -> dict[str, Any]:
    """KEY=VALUE strings -> {KEY: VALUE}, each VALUE a Python literal where it parses as one (1, 0.5,
    True, "x") and the raw string otherwise. ValueError names `flag` on an item without '='."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} expects KEY=VALUE, got {item!r}")
        try:
            options[key.strip()] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            options[key.strip()] = raw
    return options
