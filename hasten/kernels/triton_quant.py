"""Weight-only int4 / int8 matmuls in Triton (the GPU counterparts of quant_linear_cpu.cpp).

    int4_matmul(x, codes, scales, mins, group) = x @ dequant(codes, scales, mins)^T
    int8_matmul(x, qweight, scales)            = x @ (qweight * scales[:, None])^T

over the layouts of `hasten.quant.formats` (`Int4Weight`: uint8 codes [N, K / 2], value k in
nibble k % 2 of byte k / 2, low first, one (scale, min) pair per `group` k; `Int8Weight`: int8
[N, K] and one scale per row). Each program computes a BLOCK_M x BLOCK_N tile of y: it loads a
BLOCK_N x BLOCK_K / 2 block of code bytes, splits the nibbles into the even-k and odd-k halves,
scales them with their groups' (scale, min) in registers and feeds two `tl.dot`s with the even and
odd columns of x. K and the group size are compile-time constants (a model has a handful of K). The dequantized weight never exists in memory, so a decode step reads 4.5
(int4, group 32, fp16 scale and min) or 8 bits per weight. Accumulation is in float32; the
weight is cast to x's dtype for the dot (fp16 / bf16 tensor cores on a GPU).

On a CPU these run in Triton's interpreter (`TRITON_INTERPRET=1`, set before Triton is imported):
that is how the tests check them against the PyTorch reference on a machine without a GPU.
`benchmarks/triton_quant_gpu.py` times them on a GPU.
"""

from __future__ import annotations

import functools

import torch

from hasten.kernels.triton import available  # noqa: F401 - whether Triton imports here


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def int4_kernel(x_ptr, codes_ptr, scales_ptr, mins_ptr, y_ptr, M, N, stride_xm, stride_ym,
                    K: tl.constexpr, G: tl.constexpr, group: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_b = tl.arange(0, BLOCK_K // 2)  # code bytes of the k block
        m_ok = offs_m[:, None] < M
        n_ok = offs_n[:, None] < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K):
            byte = k0 // 2 + offs_b
            b_ok = byte[None, :] < K // 2
            even = 2 * byte  # the k of the low nibbles; +1 for the high ones (same group: group is even)
            x_even = tl.load(x_ptr + offs_m[:, None] * stride_xm + even[None, :], mask=m_ok & b_ok, other=0.0)
            x_odd = tl.load(x_ptr + offs_m[:, None] * stride_xm + even[None, :] + 1, mask=m_ok & b_ok, other=0.0)
            codes = tl.load(codes_ptr + offs_n[:, None] * (K // 2) + byte[None, :], mask=n_ok & b_ok, other=0)
            gidx = offs_n[:, None] * G + (even // group)[None, :]
            scale = tl.load(scales_ptr + gidx, mask=n_ok & b_ok, other=0.0).to(tl.float32)
            low = tl.load(mins_ptr + gidx, mask=n_ok & b_ok, other=0.0).to(tl.float32)
            w_even = ((codes & 0x0F).to(tl.float32) * scale + low).to(x_even.dtype)
            w_odd = ((codes >> 4).to(tl.float32) * scale + low).to(x_even.dtype)
            acc += tl.dot(x_even, tl.trans(w_even))
            acc += tl.dot(x_odd, tl.trans(w_odd))
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc, mask=m_ok & (offs_n[None, :] < N))

    @triton.jit
    def int8_kernel(x_ptr, q_ptr, scales_ptr, y_ptr, M, N, stride_xm, stride_ym, K: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m[:, None] < M
        n_ok = offs_n[:, None] < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_ok = k[None, :] < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok & k_ok, other=0.0)
            q = tl.load(q_ptr + offs_n[:, None] * K + k[None, :], mask=n_ok & k_ok, other=0)
            acc += tl.dot(x, tl.trans(q.to(x.dtype)))
        scale = tl.load(scales_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc * scale[None, :],
                 mask=m_ok & (offs_n[None, :] < N))

    return int4_kernel, int8_kernel


def _blocks(M: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): decode-sized row counts take the smallest tile tl.dot allows in M and
    wider tiles in N (more weight per program); prefill takes square-ish tiles."""
    if M <= 16:
        return 16, 64
    if M <= 64:
        return 32, 64
    return 64, 64


def _check(x: torch.Tensor, w: torch.Tensor, K: int, block_k: int, min_block_k: int) -> None:
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"x must be [M, {K}], got {tuple(x.shape)}")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device}, the weight on {w.device}")
    if not x.is_floating_point():
        raise ValueError("x must be a float tensor")
    if block_k < min_block_k or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two >= {min_block_k}")


def _launch(kernel, x: torch.Tensor, N: int, *args, **constants) -> torch.Tensor:
    """Runs kernel[grid](x, *args, y, M, N, x.stride(0), y.stride(0), **constants, BLOCK_M, BLOCK_N)
    over the tiles of y [M, N] (float32 inside, returned in x's dtype)."""
    import triton

    x = x.contiguous()
    M = x.shape[0]
    y = torch.empty((M, N), device=x.device, dtype=torch.float32)
    bm, bn = _blocks(M)
    kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](x, *args, y, M, N, x.stride(0), y.stride(0), **constants,
                                                     BLOCK_M=bm, BLOCK_N=bn)
    return y.to(x.dtype)


def int4_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                group: int, block_k: int = 64) -> torch.Tensor:
    """y [M, N] (x's dtype) = x [M, K] @ dequant(codes [N, K/2], scales/mins [N, K/group])^T."""
    N, K = codes.shape[0], codes.shape[1] * 2
    _check(x, codes, K, block_k, 32)
    if codes.dtype != torch.uint8 or group % 2 or K % group or scales.shape != (N, K // group) \
            or mins.shape != scales.shape:
        raise ValueError("codes must be uint8 [N, K/2] and scales, mins [N, K/group] with an even group")
    int4_kernel, _ = _kernels()
    return _launch(int4_kernel, x, N, codes.contiguous(), scales.contiguous(), mins.contiguous(),
                   K=K, G=K // group, group=group, BLOCK_K=block_k)


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, block_k: int = 64) -> torch.Tensor:
    """y [M, N] (x's dtype) = x [M, K] @ (qweight [N, K] * scales [N, 1])^T."""
    N, K = qweight.shape
    _check(x, qweight, K, block_k, 16)
    if qweight.dtype != torch.int8 or scales.numel() != N:
        raise ValueError("qweight must be int8 [N, K] and scales [N]")
    _, int8_kernel = _kernels()
    return _launch(int8_kernel, x, N, qweight.contiguous(), scales.contiguous(), K=K, BLOCK_K=block_k)
