"""Linear layers over quantized weights, with the fastest CPU path chosen per call by row count.

Small batches (decode) run PyTorch's weight-only kernels, which read the compact weight
directly: `torch._weight_int8pack_mm` (int8 per channel) and
`aten._weight_int4pack_mm_for_cpu` (int4 groups). Both are fast only with bfloat16
activations (their float32 path is a slow reference loop), so float32 activations are cast
to bfloat16 around the call. Above `max_kernel_rows` rows (prefill) the weight is dequantized
to float32 for that call and a BLAS GEMM runs instead, which wins once the dequantization is
amortised over enough rows. The output always has the activation dtype.

The int4 kernel wants codes in its own blocked layout (`_convert_weight_to_int4pack_for_cpu`);
the dequantize path reads the codes back from that layout (see `unpack_int4_kernel_layout`),
so only one copy of the codes is held. Scales and zero points are held as the kernel wants
them: bfloat16 [K // g, N, 2] with w = (q - 8) * scale + zero.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from hasten.kernels import cpu_features
from hasten.quant.formats import GroupedInt8Weight, Int4Weight, Int8Weight, QuantizedWeight

KERNEL_DTYPE = torch.bfloat16
_N_BLOCK = 32  # the CPU int4 layouts interleave rows in blocks of 32 (AVX2) or 64 + a last 32 (AVX-512)


def has_int4_kernel() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


def has_int8_kernel() -> bool:
    return hasattr(torch, "_weight_int8pack_mm")


def pack_int4_for_kernel(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (N a multiple of 32) -> the CPU kernel's packed uint8 [N, K // 2]."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)


def _unpack_blocks32(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The AVX2 build's layout: blocks of 32 rows; byte (b, kk, j) holds row b*32 + j % 16 (+16 in
    the high nibble) at column 2*kk + j // 16."""
    p = packed.reshape(n // 32, k // 2, 2, 16)  # [block, k pair, k parity, row in half]
    low = (p & 0x0F).permute(0, 3, 1, 2)  # [block, row, k pair, parity]
    high = (p >> 4).permute(0, 3, 1, 2)
    return torch.stack((low, high), dim=1).reshape(n, k)


def _unpack_blocks64(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The AVX-512 build's layout: blocks of 64 rows, byte (b, c, j) holding row b*64 + j (+32 in
    the high nibble) at column c; a last block of 32 rows has byte (c, i) holding rows 2i (low)
    and 2i + 1 (high) at column c."""
    flat = packed.reshape(-1)
    full = n // 64
    p = flat[: full * 32 * k].reshape(full, k, 32)  # [block, column, row in half]
    parts = [torch.cat(((p & 0x0F).transpose(1, 2), (p >> 4).transpose(1, 2)), dim=1).reshape(full * 64, k)]
    if n % 64:
        t = flat[full * 32 * k :].reshape(k, 16)  # [column, row pair]
        parts.append(torch.stack((t & 0x0F, t >> 4), dim=2).reshape(k, 32).t())
    return torch.cat(parts).contiguous()


_LAYOUTS = {"blocks32": _unpack_blocks32, "blocks64": _unpack_blocks64}


@functools.cache
def int4_kernel_layout() -> str | None:
    """Which packed layout this torch build writes (it depends on the CPU: AVX2 or AVX-512), found
    by packing known codes once; None when it is none of the layouts we can read."""
    if not has_int4_kernel():
        return None
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (96, 64), generator=gen, dtype=torch.uint8)
    try:
        packed = pack_int4_for_kernel(codes)
    except RuntimeError:
        return None
    for name, unpack in _LAYOUTS.items():
        try:
            if torch.equal(unpack(packed, 96, 64), codes):
                return name
        except RuntimeError:
            continue
    return None


def unpack_int4_kernel_layout(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of `pack_int4_for_kernel`: uint8 codes [n, k] (n a multiple of 32)."""
    layout = int4_kernel_layout()
    if layout is None:
        raise RuntimeError("this torch build packs int4 weights in a layout hasten cannot read")
    return _LAYOUTS[layout](packed, n, k)


def int4_kernel_layout_known() -> bool:
    """Whether this torch build packs int4 in a layout `unpack_int4_kernel_layout` reads."""
    return int4_kernel_layout() is not None


class QuantLinear:
    """Shared parts: input scaling (AWQ), bias, dtype handling and path selection."""

    kind = "quant"
    rounds_activations = False  # whether the kernel rounds x (int8 or bfloat16 activations), not float32-exact

    def __init__(self, n: int, k: int, bias: torch.Tensor | None, input_scale: torch.Tensor | None, max_kernel_rows: int):
        self.n, self.k = n, k
        self.bias = bias
        self.inv_input_scale = (1.0 / input_scale.float()) if input_scale is not None else None
        self.max_kernel_rows = max_kernel_rows
        self.use_kernel = True  # cleared when the kernel is missing in this torch build
        self.calls = {"kernel": 0, "dequant": 0, "bf16": 0, "u8": 0}
        # the bfloat16 copy of the weight for wide calls (enable_bf16_gemm); None: off
        self.bf16_weight: torch.Tensor | None = None
        self.bf16_min_rows = 0
        self.bf16_stream = True  # bf16_tiles_linear's stream (enable_bf16_gemm)
        # the 8-bit copy of the weight for wide calls (enable_u8_gemm: u8_pack_rows16's tensors); None: off
        self.u8_weight: list[torch.Tensor] | None = None
        self.u8_min_rows = 0
        self.u8_x_runs = 1
        self.u8_pow2_x_scales = False

    def enable_bf16_gemm(self, min_rows: int, tiles: bool = True, stream: bool = True) -> None:
        """From `min_rows` rows of x on (prefill chunks, wide decode batches), multiply x in bfloat16
        by a bfloat16 copy of the dequantized weight instead of the packed kernel. tiles: where the
        build and CPU have AMX-BF16 and the shape fits, the copy is kept in tile order for hasten's
        tile kernel (bf16_tiles_linear, a 5-D bf16_weight); otherwise row-major for oneDNN's GEMM
        (at::linear, which reorders it for AMX on every call). stream: the tile kernel's (bf16_tiles_linear;
        the same outputs). Costs 2 bytes per weight; the codes stay for the narrow calls."""
        from hasten.kernels.quant_linear import bf16_tiles_available, bf16_tiles_fit, bf16_tiles_pack

        if min_rows < 1:
            raise ValueError(f"bf16 GEMM min rows must be >= 1, not {min_rows}")
        weight = self.dequantize_codes().to(torch.bfloat16).contiguous()
        if tiles and bf16_tiles_fit(self.n, self.k) and bf16_tiles_available():
            weight = bf16_tiles_pack(weight)
        self.bf16_weight = weight
        self.bf16_min_rows = min_rows
        self.bf16_stream = stream

    def enable_u8_gemm(self, min_rows: int, x_runs: int = 1, pow2_x_scales: bool = False) -> None:
        """From `min_rows` rows of x on, x rounded to int8 per 32 values times an 8-bit-per-row copy of
        the dequantized weight (u8_linear_q8_gemm: integer multiply-adds without the int4 tiles' nibble
        unpacking and per-32 weight scales). Costs 1 byte per weight; the codes stay for narrow calls.
        x_runs (1 .. 8): up to that many consecutive 32-runs of x share one int8 scale; pow2_x_scales:
        each scale rounded up to a power of two (u8_linear_q8_gemm)."""
        from hasten.kernels.quant_linear import u8_pack_rows16

        if min_rows < 1:
            raise ValueError(f"u8 GEMM min rows must be >= 1, not {min_rows}")
        if not 1 <= x_runs <= 8:
            raise ValueError(f"u8 GEMM x runs must be 1 .. 8, not {x_runs}")
        if self.k % 32:
            raise ValueError(f"the u8 GEMM needs in_features divisible by 32, not {self.k}")
        self.u8_weight = u8_pack_rows16(self.dequantize_codes().float().contiguous())
        self.u8_min_rows = min_rows
        self.u8_x_runs = x_runs
        self.u8_pow2_x_scales = pow2_x_scales

    def takes_u8(self, rows: int) -> bool:
        return self.u8_weight is not None and rows >= self.u8_min_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.inv_input_scale is not None:
            x = x * self.inv_input_scale.to(x.dtype)
        if self.bf16_weight is not None and x.shape[0] >= self.bf16_min_rows:
            self.calls["bf16"] += 1
            if self.bf16_weight.dim() == 5:
                from hasten.kernels.quant_linear import bf16_tiles_linear

                y = bf16_tiles_linear(x.float().contiguous(), self.bf16_weight, self.bf16_stream).to(x.dtype)
            else:
                y = F.linear(x.to(torch.bfloat16), self.bf16_weight).to(x.dtype)
        elif self.takes_u8(x.shape[0]):
            from hasten.kernels.quant_linear import u8_linear_q8_gemm

            self.calls["u8"] += 1
            y = self._float32_call(u8_linear_q8_gemm, x, *self.u8_weight, self.n, self.u8_x_runs, self.u8_pow2_x_scales)
        elif self.use_kernel and x.shape[0] <= self.max_kernel_rows:
            self.calls["kernel"] += 1
            y = self._run_kernel(x)
        else:
            self.calls["dequant"] += 1
            y = F.linear(x.float(), self.dequantize_codes()).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def _run_kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The packed kernel on x (any float dtype); returns x's dtype."""
        return self._kernel(x.to(KERNEL_DTYPE)).to(x.dtype)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def _float32_call(op, x: torch.Tensor, *weights) -> torch.Tensor:
        """op(x, *weights) for hasten's C++ kernels (contiguous float32 x); returns x's dtype. The
        decode hot path (x already contiguous float32) converts nothing."""
        if x.dtype == torch.float32 and x.is_contiguous():
            return op(x, *weights)
        return op(x.float().contiguous(), *weights).to(x.dtype)

    def dequantize_codes(self) -> torch.Tensor:
        """float32 [N, K] weight as the kernel sees it (without the input scale)."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] weight this layer multiplies the unscaled input by."""
        w = self.dequantize_codes()
        return w * self.inv_input_scale[None, :] if self.inv_input_scale is not None else w

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def _shared_nbytes(self) -> int:
        """Bytes of what every kind may hold besides its codes: AWQ input scale, bias, bfloat16 copy."""
        total = self.inv_input_scale.numel() * 4 if self.inv_input_scale is not None else 0
        total += self.bias.numel() * self.bias.element_size() if self.bias is not None else 0
        total += sum(t.numel() * t.element_size() for t in self.u8_weight) if self.u8_weight is not None else 0
        return total + (self.bf16_weight.numel() * 2 if self.bf16_weight is not None else 0)


INT8_KERNELS = ("auto", "hasten", "hasten-q8", "torch")
INT8_AUTO = "hasten"  # hasten's own int8 quantization: exact
# a GGUF's Q8_0 rows (the tied embedding / lm_head): llama.cpp's scheme, x rounded to int8 per 32
INT8_AUTO_GGUF = "hasten-q8"


def resolve_int8_kernel(name: str, auto: str = INT8_AUTO) -> str:
    """Which int8 matmul runs:
    "hasten"    our C++ kernel (weight blocks dequantized in cache, float32 activations, exact);
    "hasten-q8" x rounded to int8 per 32 values, integer multiply-adds (int8_linear_q8_gemm);
    "torch"     torch._weight_int8pack_mm, bfloat16 activations.
    "auto" picks `auto` when our kernels build here, else torch."""
    if name not in INT8_KERNELS:
        raise ValueError(f"int8 kernel must be one of {INT8_KERNELS}, got {name!r}")
    if name == "torch":
        return "torch"
    from hasten.kernels import quant_linear

    if quant_linear.load() is None:
        if name != "auto":
            raise RuntimeError(f"the hasten int8 kernel cannot run here: {quant_linear.load_error()}")
        return "torch"
    return auto if name == "auto" else name


class Int8Linear(QuantLinear):
    kind = "int8"

    @property
    def rounds_activations(self) -> bool:
        return self.kernel != "hasten"  # hasten-q8: int8 x; torch: bfloat16 x

    def __init__(self, qw: Int8Weight, max_kernel_rows: int = 32, kernel: str = "auto", auto: str = INT8_AUTO):
        n, k = qw.shape
        self.kernel = resolve_int8_kernel(kernel, auto)
        if self.kernel == "hasten-q8" and k % 32:
            self.kernel = "hasten"  # x is rounded per 32 values: K must split into such runs
        ours = self.kernel.startswith("hasten")
        # our kernels have a path for every row count (max_kernel_rows is torch's kernel's limit)
        super().__init__(n, k, qw.bias, qw.input_scale, 1 << 62 if ours else max_kernel_rows)
        self.qweight = qw.qweight.contiguous()
        self.rows8: list[torch.Tensor] | None = None  # int8_linear_q8_gemm's layout (hasten-q8)
        if ours:
            from hasten.kernels.quant_linear import int8_linear, int8_linear_q8_gemm, int8_pack_rows8

            self._op = int8_linear
            self.scales = qw.scales.float().contiguous()
            if self.kernel == "hasten-q8":
                self._op = int8_linear_q8_gemm
                self.rows8 = int8_pack_rows8(self.qweight, self.scales)
        else:
            self.scales = qw.scales.to(KERNEL_DTYPE).contiguous()
            self.use_kernel = has_int8_kernel()

    def _run_kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows8 is not None:
            return self._float32_call(self._op, x, *self.rows8, self.n)
        if self.kernel != "hasten":
            return super()._run_kernel(x)
        return self._float32_call(self._op, x, self.qweight, self.scales)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x.contiguous(), self.qweight, self.scales)

    def dequantize_codes(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    @property
    def nbytes(self) -> int:
        total = self.qweight.numel() + self.scales.numel() * self.scales.element_size()
        total += sum(t.numel() * t.element_size() for t in self.rows8) if self.rows8 is not None else 0
        return total + self._shared_nbytes()


INT4_KERNELS = ("auto", "hasten", "hasten-q8", "torch")
# auto for hasten's own int4 (RTN / AWQ): exact; int8 activations would take AWQ past its 6 %
# perplexity bound (+6.23 % vs +4.27 %, docs/quantization.md)
INT4_AUTO = "hasten"
# auto for a GGUF's Q4_0 / Q4_1 blocks: llama.cpp's own scheme for these formats (int8 activations,
# +1.9 % instead of +0.2 % perplexity, ~1.15-1.25x the batch-1 decode rate)
INT4_AUTO_GGUF = "hasten-q8"


def resolve_int4_kernel(name: str, group_size: int, auto: str = INT4_AUTO) -> str:
    """Which int4 matmul runs:
    "hasten"    our C++ kernel, float32 activations (exact against the dequantized weight);
    "hasten-q8" the same with activations rounded to int8 per 32 values (llama.cpp's scheme);
    "torch"     aten._weight_int4pack_mm_for_cpu with bfloat16 activations.
    "auto" picks `auto` when our kernel builds here, else torch."""
    if name not in INT4_KERNELS:
        raise ValueError(f"int4 kernel must be one of {INT4_KERNELS}, got {name!r}")
    if name == "torch":
        return "torch"
    from hasten.kernels import quant_linear as int4_linear

    usable = group_size % 32 == 0 and int4_linear.load() is not None
    if name != "auto" and not usable:
        raise RuntimeError(f"the hasten int4 kernel cannot run here: {int4_linear.load_error() or 'group size'}")
    if not usable:
        return "torch"
    return auto if name == "auto" else name


class Int4HastenLinear(QuantLinear):
    """int4 groups through hasten's C++ kernel (hasten/kernels/quant_linear_cpu.cpp): codes kept in
    the Int4Weight layout, scale and min per group as float16, float32 activations throughout."""

    kind = "int4"

    # From this many rows of x on (batched decode, prefill) the kernel dequantizes 48 weight rows
    # at a time into cache and multiplies them there (int4_linear_gemm; with int8 activations
    # int4_linear_q8_gemm); one row (batch-1 decode) takes the dot-product kernel that unpacks the
    # codes in registers, or with quant_q8_gemm_one_row the int8 GEMM too (gemm_min_rows 1).
    gemm_min_rows = 2

    @property
    def rounds_activations(self) -> bool:
        return self.int8_activations

    def __init__(self, qw: Int4Weight, max_kernel_rows: int = 32, int8_activations: bool = False,
                 q8_gemm: bool = True):
        """int8_activations: x rounded to int8 per 32 values (llama.cpp's scheme); with q8_gemm also for
        2+ rows, through int4_linear_q8_gemm over a second copy of the codes (8 rows side by side)."""
        n, k = qw.shape
        # max_kernel_rows does not apply: the GEMM path is never slower than dequantize + matmul
        super().__init__(n, k, qw.bias, qw.input_scale, 1 << 62)
        from hasten.kernels.quant_linear import (
            int4_linear,
            int4_linear_gemm,
            int4_linear_q8,
            int4_linear_q8_gemm,
            int4_pack_rows8,
        )

        self.int8_activations = int8_activations
        self._op = int4_linear_q8 if int8_activations else int4_linear
        self._gemm = int4_linear_gemm
        self._gemm8 = int4_linear_q8_gemm
        self.group_size = qw.group_size
        self.codes = qw.qweight.contiguous()
        self.scales = qw.scales.to(torch.float16).contiguous()
        self.mins = qw.mins.to(torch.float16).contiguous()
        self.rows8: list[torch.Tensor] | None = None  # int4_linear_q8_gemm's layout (packed, scales8, mins8)
        if int8_activations and q8_gemm:
            self.rows8 = int4_pack_rows8(self.codes, self.scales, self.mins, self.group_size)

    def _run_kernel(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= self.gemm_min_rows and self.rows8 is not None:
            return self._float32_call(self._gemm8, x, *self.rows8, self.group_size, self.n)
        op = self._op if x.shape[0] < self.gemm_min_rows else self._gemm
        return self._float32_call(op, x, self.codes, self.scales, self.mins, self.group_size)

    def dequantize_codes(self) -> torch.Tensor:
        g = self.group_size
        q = torch.stack((self.codes & 0x0F, self.codes >> 4), dim=-1).view(self.n, self.k // g, g).float()
        return (q * self.scales.float()[..., None] + self.mins.float()[..., None]).view(self.n, self.k)

    @property
    def nbytes(self) -> int:
        total = self.codes.numel() + (self.scales.numel() + self.mins.numel()) * 2
        total += sum(t.numel() * t.element_size() for t in self.rows8) if self.rows8 is not None else 0
        return total + self._shared_nbytes()


class Int4Linear(QuantLinear):
    kind = "int4"

    rounds_activations = True  # aten's int4pack kernel takes bfloat16 x

    def __init__(self, qw: Int4Weight, max_kernel_rows: int = 32):
        n, k = qw.shape
        super().__init__(n, k, qw.bias, qw.input_scale, max_kernel_rows)
        self.group_size = qw.group_size
        self.n_pad = -(-n // _N_BLOCK) * _N_BLOCK
        pad = self.n_pad - n
        codes = qw.unpack()
        scales, mins = qw.scales.float(), qw.mins.float()
        if pad:
            codes = F.pad(codes, (0, 0, 0, pad))
            scales = F.pad(scales, (0, 0, 0, pad))
            mins = F.pad(mins, (0, 0, 0, pad))
        zeros = mins + 8.0 * scales  # the kernel computes (q - 8) * scale + zero
        self.scales_zeros = torch.stack((scales.t(), zeros.t()), dim=-1).to(KERNEL_DTYPE).contiguous()
        self.codes: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None
        self.use_kernel = has_int4_kernel()
        if self.use_kernel:
            self.packed = pack_int4_for_kernel(codes)
            if not int4_kernel_layout_known():
                self.codes = qw.qweight  # layout unknown: keep our own copy for the dequant path
        else:
            self.codes = qw.qweight

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.group_size, self.scales_zeros)
        return y[:, : self.n] if self.n_pad != self.n else y

    def dequantize_codes(self) -> torch.Tensor:
        if self.codes is not None:
            q = torch.stack((self.codes & 0x0F, self.codes >> 4), dim=-1).view(self.n, self.k)
        else:
            q = unpack_int4_kernel_layout(self.packed, self.n_pad, self.k)[: self.n]
        g = self.group_size
        sz = self.scales_zeros[:, : self.n].float()  # [K // g, N, 2]
        scale = sz[..., 0].t().unsqueeze(-1)
        zero = sz[..., 1].t().unsqueeze(-1)
        w = (q.view(self.n, self.k // g, g).float() - 8.0) * scale + zero
        return w.view(self.n, self.k)

    @property
    def nbytes(self) -> int:
        total = self.scales_zeros.numel() * 2
        total += self.packed.numel() if self.packed is not None else 0
        total += self.codes.numel() if self.codes is not None else 0
        return total + self._shared_nbytes()


class GroupedInt8Linear(QuantLinear):
    """Grouped int8 weights (GGUF Q5_0 / Q5_1 / Q5_K / Q6_K / Q8_0): int8g_linear_q8_gemm for every row
    count (x rounded to int8 per 32 values, llama.cpp's scheme for these blocks), from the layout of
    int8g_pack_rows8 only. Without the C++ kernels, or with int8_activations=False, each call
    dequantizes the weight to float32 and multiplies exactly (the reference path, slow)."""

    kind = "int8g"

    @property
    def rounds_activations(self) -> bool:
        return self.int8_activations

    def __init__(self, qw: GroupedInt8Weight, int8_activations: bool = True):
        n, k = qw.shape
        super().__init__(n, k, qw.bias, qw.input_scale, 1 << 62)
        from hasten.kernels import quant_linear

        self.group_size = qw.group_size
        self.int8_activations = int8_activations and quant_linear.load() is not None and k % 32 == 0
        self.use_kernel = self.int8_activations
        self.rows8: list[torch.Tensor] | None = None
        self.float_path: GroupedInt8Weight | None = None  # kept only for the dequantizing path
        if self.use_kernel:
            scales = qw.scales.float().contiguous()
            mins = qw.mins.float().contiguous() if qw.mins is not None else None
            self.rows8 = quant_linear.int8g_pack_rows8(qw.qweight.contiguous(), scales, mins, qw.group_size)
            self._op = quant_linear.int8g_linear_q8_gemm
        else:
            self.float_path = GroupedInt8Weight(qw.qweight.contiguous(), qw.scales.float(),
                                            None if qw.mins is None else qw.mins.float(), qw.group_size)

    def _run_kernel(self, x: torch.Tensor) -> torch.Tensor:
        return self._float32_call(self._op, x, *self.rows8, self.group_size, self.n)

    def dequantize_codes(self) -> torch.Tensor:
        if self.float_path is not None:
            return self.float_path.dequantize()
        packed, s8, m8 = self.rows8
        n8 = packed.shape[0]
        pos = packed.permute(0, 2, 1, 3).reshape(n8 * 8, self.k)[: self.n].float()  # run-order positions
        p = torch.arange(self.k) % 32
        k_of_pos = torch.arange(self.k) - p + torch.where(p < 16, 2 * p, 2 * (p - 16) + 1)
        q = torch.empty_like(pos)
        q[:, k_of_pos] = pos
        g = self.group_size
        scales = s8.permute(0, 2, 1).reshape(n8 * 8, -1)[: self.n]
        w = q.view(self.n, self.k // g, g) * scales[..., None]
        if m8.numel():
            w = w + m8.permute(0, 2, 1).reshape(n8 * 8, -1)[: self.n][..., None]
        return w.view(self.n, self.k)

    @property
    def nbytes(self) -> int:
        tensors = self.rows8 if self.rows8 is not None else [
            t for t in (self.float_path.qweight, self.float_path.scales, self.float_path.mins) if t is not None]
        total = sum(t.numel() * t.element_size() for t in tensors)
        return total + self._shared_nbytes()


def make_layer(qw: QuantizedWeight | GroupedInt8Weight, max_kernel_rows: int = 32, int4_kernel: str = "auto",
               int8_kernel: str = "auto", int4_auto: str = INT4_AUTO, q8_gemm: bool = True,
               int8_auto: str = INT8_AUTO, bf16_gemm: str = "off", bf16_gemm_min_rows: int = 32,
               u8_gemm: str = "off", u8_gemm_min_rows: int = 16, u8_gemm_x_runs: int = 1,
               u8_gemm_pow2_x_scales: bool = False, bf16_gemm_tiles: bool = True,
               q8_gemm_one_row: str = "off", bf16_gemm_stream: bool = True) -> QuantLinear:
    """The layer for `qw`. bf16_gemm (quant_bf16_gemm: auto | on | off) adds the bfloat16 path for calls
    of bf16_gemm_min_rows rows or more; auto does so where the CPU has AMX, for layers whose kernel
    rounds x anyway (int8 or bfloat16 activations), so exact float32-activation layers stay exact;
    bf16_gemm_tiles: that path on hasten's AMX tile kernel where the build, CPU and shape allow it;
    bf16_gemm_stream: that kernel's stream (bf16_tiles_linear).
    u8_gemm (quant_u8_gemm) adds the 8-bit copy for calls of u8_gemm_min_rows rows or more that the
    bfloat16 path does not take; auto does so where the build has its AVX-512 VNNI tiles, for 4-bit
    layers with int8 activations (an 8-bit row keeps a 4-bit block's values to within 1/510 of the
    row's range; the 5- to 8-bit blocks keep their own kernel); u8_gemm_x_runs, u8_gemm_pow2_x_scales:
    see enable_u8_gemm. q8_gemm_one_row (quant_q8_gemm_one_row): one-row calls of int4 layers with int8
    activations and the GEMM copy (batch-1 decode) take the GEMM tiles too; auto where they lack VNNI."""
    layer: QuantLinear
    if isinstance(qw, Int8Weight):
        layer = Int8Linear(qw, max_kernel_rows, int8_kernel, int8_auto)
    elif isinstance(qw, GroupedInt8Weight):
        layer = GroupedInt8Linear(qw, int8_activations=resolve_int8_kernel(int8_kernel, int8_auto) == "hasten-q8")
    else:
        kernel = resolve_int4_kernel(int4_kernel, qw.group_size, int4_auto)
        if kernel.startswith("hasten"):
            layer = Int4HastenLinear(qw, max_kernel_rows, int8_activations=kernel == "hasten-q8", q8_gemm=q8_gemm)
            if layer.rows8 is not None and cpu_features.resolve_q8_gemm_one_row(q8_gemm_one_row):
                layer.gemm_min_rows = 1
        else:
            layer = Int4Linear(qw, max_kernel_rows)
    rows = cpu_features.resolve_bf16_rows("quant_bf16_gemm", bf16_gemm, bf16_gemm_min_rows, layer.rounds_activations)
    if rows:
        layer.enable_bf16_gemm(rows, bf16_gemm_tiles, bf16_gemm_stream)
    auto_u8 = isinstance(layer, Int4HastenLinear) and layer.int8_activations
    rows = cpu_features.resolve_u8_rows(u8_gemm, u8_gemm_min_rows, auto_u8)
    if rows:
        layer.enable_u8_gemm(rows, u8_gemm_x_runs, u8_gemm_pow2_x_scales)
    return layer
