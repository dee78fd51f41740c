"""The glue between the matmuls of a decoder layer in Triton (the GPU counterparts of
hasten/kernels/decoder_ops_cpu.cpp):

    rms_norm(x, w, eps)             -> w * (x * rsqrt(mean(x^2) + eps)), statistics in float32
    add_rms_norm(h, delta, w, eps)  -> h += delta (in place, rounded to h's dtype), rms_norm(h)
    rope_and_cache(qkv, cos, sin, positions, slots, k_cache, v_cache, heads, kv_heads)
                                    -> q [T, H, D] rotated; rotated k and raw v stored in their slots
    kv_write(k, v, slots, k_cache, v_cache)  -> k and v stored in their slots
    silu_mul(gate_up)               -> silu(gate) * up for gate_up = [gate | up]
    gelu_tanh_mul(gate_up)          -> gelu_tanh(gate) * up

Rounding follows Hugging Face transformers' PyTorch code in float16 / bfloat16: values are loaded
in the tensor dtype, computed in float32 and rounded back to the dtype at every point where an
eager PyTorch op would round (the normalized row before the weight, each RoPE product before the
sum, the activation before the product with `up`). float32 mul + add is never fused into an FMA
(kernels launch with enable_fp_fusion=False), so float32 RoPE matches eager PyTorch bit for bit.
What is not reproduced bit for bit: the mean of squares is summed in another order than
torch.mean, and exp / tanh are not PyTorch's float32 implementations, so the normalized row and the
activations can differ from PyTorch's in the last float32 bits, and now and then round to the
neighbouring float16 / bfloat16 value (tests/gpu/test_triton_ops.py states the bounds).

Each op has a plain-PyTorch `*_reference` next to it, what the tests compare against. Rows with a
negative slot (padding rows of a captured CUDA graph) write nothing to the caches. Kernels are
defined on first use (`_kernels()`), so importing this module does not import Triton.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_MAX_NORM_WIDTH = 32768  # rms_norm holds a whole row in one program


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, stride_x, stride_d, stride_o, N, eps,
                    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        # one program per row; with HAS_DELTA the row x += delta is rounded, stored back in
        # place, and normalized from the rounded values
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x_row = x_ptr + row * stride_x
        x = tl.load(x_row + cols, mask=ok, other=0.0)
        if HAS_DELTA:
            d = tl.load(delta_ptr + row * stride_d + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(x_row + cols, x, mask=ok)
        h = x.to(tl.float32)
        mean = tl.sum(h * h, axis=0) / N
        inv = 1.0 / tl.sqrt_rn(mean + eps)
        normed = (h * inv).to(out_ptr.dtype.element_ty)  # HF: h.to(dtype) before the weight
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        y = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_o + cols, y, mask=ok)

    @triton.jit
    def rope_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, stride_t,
                    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                    HB: tl.constexpr, DB: tl.constexpr):
        # program (t, j): heads j*HB .. j*HB + HB - 1 of token t, counted over q, k and v heads
        # together; q and k heads are rotated, v heads are copied
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * HB + tl.arange(0, HB)
        d = tl.arange(0, DB)
        half: tl.constexpr = R // 2
        head_ok = h < HEADS + 2 * KV_HEADS
        col_ok = d < D
        ok = head_ok[:, None] & col_ok[None, :]
        src = qkv_ptr + t * stride_t + h[:, None] * D
        x = tl.load(src + d[None, :], mask=ok, other=0.0)
        # rotate_half pairs dim i with i + R/2 (the first half takes the negated partner)
        rot = d < R
        partner = tl.where(d < half, d + half, d - half)
        xp = tl.load(src + partner[None, :], mask=ok & rot[None, :], other=0.0).to(tl.float32)
        xp = tl.where((d < half)[None, :], -xp, xp)
        pos = tl.load(pos_ptr + t)
        c = tl.load(cos_ptr + pos * R + d, mask=rot, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + pos * R + d, mask=rot, other=0.0).to(tl.float32)
        dt = qkv_ptr.dtype.element_ty
        a = (x.to(tl.float32) * c[None, :]).to(dt)  # each product rounded, then the sum
        b = (xp * s[None, :]).to(dt)
        y = (a.to(tl.float32) + b.to(tl.float32)).to(dt)
        rotated = (h < HEADS + KV_HEADS)[:, None] & rot[None, :]
        y = tl.where(rotated, y, x)
        tl.store(q_ptr + t * (HEADS * D) + h[:, None] * D + d[None, :], y, mask=ok & (h < HEADS)[:, None])
        slot = tl.load(slot_ptr + t)
        dst = slot * (KV_HEADS * D) + d[None, :]
        is_k = (h >= HEADS) & (h < HEADS + KV_HEADS)
        is_v = (h >= HEADS + KV_HEADS) & head_ok
        tl.store(k_ptr + dst + (h - HEADS)[:, None] * D, y.to(k_ptr.dtype.element_ty),
                 mask=ok & is_k[:, None] & (slot >= 0))
        tl.store(v_ptr + dst + (h - HEADS - KV_HEADS)[:, None] * D, y.to(v_ptr.dtype.element_ty),
                 mask=ok & is_v[:, None] & (slot >= 0))

    @triton.jit
    def kv_write_kernel(k_ptr, v_ptr, slot_ptr, kc_ptr, vc_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                        KV_HEADS: tl.constexpr, D: tl.constexpr, HB: tl.constexpr, DB: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * HB + tl.arange(0, HB)
        d = tl.arange(0, DB)
        slot = tl.load(slot_ptr + t)
        ok = (h < KV_HEADS)[:, None] & (d < D)[None, :] & (slot >= 0)
        dst = slot * (KV_HEADS * D) + h[:, None] * D + d[None, :]
        k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=ok, other=0.0)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=ok, other=0.0)
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=ok)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def gated_kernel(gu_ptr, out_ptr, stride_g, stride_o, inter, GELU: tl.constexpr, BLOCK: tl.constexpr):
        # program (t, j): columns j*BLOCK .. of row t; act(gate) rounded to the dtype, then * up
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        g = tl.load(gu_ptr + t * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + t * stride_g + inter + cols, mask=ok, other=0.0).to(tl.float32)
        if GELU:
            # PyTorch's 0.5 x (1 + tanh(z)), z = sqrt(2 / pi) (x + 0.044715 x^3), with
            # tanh(z) = 2 / (1 + exp(-2 z)) - 1: rounded like a float32 tanh, 1 + tanh(z) cancels
            # to the same multiples of 2^-24 as PyTorch's where x is very negative
            z = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
            th = 2.0 / (1.0 + tl.exp(-2.0 * z)) - 1.0
            act = 0.5 * g * (1.0 + th)
        else:
            act = g / (1.0 + tl.exp(-g))
        dt = out_ptr.dtype.element_ty
        y = (act.to(dt).to(tl.float32) * u).to(dt)
        tl.store(out_ptr + t * stride_o + cols, y, mask=ok)

    return norm_kernel, rope_kernel, kv_write_kernel, gated_kernel


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _warps(block: int) -> int:
    """Warps for a program that holds `block` elements: 1 per 256 elements, 1 to 16."""
    return max(1, min(16, block // 256))


def _check_rows(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be a 2-D [T, N] tensor, got shape {tuple(x.shape)}")
    if x.dtype not in _FLOATS:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"{name} must have contiguous rows (column stride 1), got strides {x.stride()}")


def _check_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    _check_rows("x", x)
    if weight.dim() != 1 or weight.shape[0] != x.shape[1] or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{x.shape[1]}] tensor, got shape {tuple(weight.shape)}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight ({weight.dtype}, {weight.device}) must match x ({x.dtype}, {x.device})")


def _launch_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor) -> torch.Tensor:
    T, N = x.shape
    if N > _MAX_NORM_WIDTH:
        raise ValueError(f"rows wider than {_MAX_NORM_WIDTH} are not supported (one block per row), got {N}")
    if T == 0:
        return out
    block = _pow2(N)
    norm_kernel = _kernels()[0]
    d = x if delta is None else delta
    norm_kernel[(T,)](x, d, weight, out, x.stride(0), d.stride(0), out.stride(0), N, float(eps),
                      HAS_DELTA=delta is not None, BLOCK=block, num_warps=_warps(block), enable_fp_fusion=False)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of the rows of x [T, N] (row stride free, column stride 1) into `out` (a new or the
    given contiguous [T, N] tensor of x's dtype)."""
    _check_norm(x, weight)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(x.shape)} {x.dtype} tensor on {x.device}")
    return _launch_norm(x, None, weight, eps, out)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: statistics in float32, the normalized row rounded to the dtype
    before the weight multiplies it."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += delta in place (rounded to the dtype), then returns rms_norm(residual) (new)."""
    _check_norm(residual, weight)
    _check_rows("delta", delta)
    if delta.shape != residual.shape or delta.dtype != residual.dtype or delta.device != residual.device:
        raise ValueError(f"delta ({tuple(delta.shape)}, {delta.dtype}) must match the residual "
                         f"({tuple(residual.shape)}, {residual.dtype})")
    out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    return _launch_norm(residual, delta, weight, eps, out)


def add_rms_norm_reference(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> torch.Tensor:
    residual.add_(delta)
    return rms_norm_reference(residual, weight, eps)


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_heads: int, head_dim: int) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"the caches must share a [blocks, block_size, KVH, D] shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the caches must be contiguous")
    if k_cache.shape[2] != kv_heads or k_cache.shape[3] != head_dim:
        raise ValueError(f"the caches hold {k_cache.shape[2]} heads of {k_cache.shape[3]} dims, "
                         f"expected {kv_heads} of {head_dim}")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in _FLOATS:
        raise ValueError(f"the caches must share a float dtype, got {k_cache.dtype} and {v_cache.dtype}")


def _check_index(name: str, idx: torch.Tensor, T: int, device: torch.device) -> None:
    if idx.dtype != torch.int64 or idx.dim() != 1 or idx.shape[0] != T or not idx.is_contiguous():
        raise ValueError(f"{name} must be a contiguous int64 [{T}] tensor, got {idx.dtype} {tuple(idx.shape)}")
    if idx.device != device:
        raise ValueError(f"{name} is on {idx.device}, expected {device}")


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
                   kv_heads: int) -> torch.Tensor:
    """RoPE (rotate-half, over the first R = cos.shape[1] dims of each head) of the q and k heads of
    qkv [T, (heads + 2 kv_heads) * D] at `positions`; returns q [T, heads, D] (new) and stores the
    rotated k and the v heads at the flat cache slots `slots` (block * block_size + offset; rows
    with a negative slot store nothing), converted to the caches' dtype."""
    _check_rows("qkv", qkv)
    T, width = qkv.shape
    if heads <= 0 or kv_heads <= 0 or width % (heads + 2 * kv_heads):
        raise ValueError(f"qkv width {width} is not (heads + 2 kv_heads) * head_dim for heads={heads}, "
                         f"kv_heads={kv_heads}")
    D = width // (heads + 2 * kv_heads)
    _check_caches(k_cache, v_cache, kv_heads, D)
    if cos.dim() != 2 or cos.shape != sin.shape or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"cos and sin must be contiguous [max_len, R] tables, got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    R = cos.shape[1]
    if R <= 0 or R % 2 or R > D:
        raise ValueError(f"the rotary dim {R} must be even and at most head_dim {D}")
    if cos.dtype != qkv.dtype or sin.dtype != qkv.dtype:
        raise ValueError(f"cos/sin ({cos.dtype}, {sin.dtype}) must share qkv's dtype {qkv.dtype}")
    for t in (cos, sin, k_cache, v_cache):
        if t.device != qkv.device:
            raise ValueError(f"all tensors must be on {qkv.device}, found one on {t.device}")
    _check_index("positions", positions, T, qkv.device)
    _check_index("slots", slots, T, qkv.device)
    q = torch.empty((T, heads, D), dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    db = _pow2(D)
    total = heads + 2 * kv_heads
    hb = max(1, min(_pow2(total), 2048 // db))
    rope_kernel = _kernels()[1]
    rope_kernel[(T, _cdiv(total, hb))](
        qkv, cos, sin, positions, slots, q, k_cache, v_cache, qkv.stride(0), HEADS=heads, KV_HEADS=kv_heads,
        D=D, R=R, HB=hb, DB=db, num_warps=_warps(hb * db), enable_fp_fusion=False)
    return q


def rope_and_cache_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                             slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
                             kv_heads: int) -> torch.Tensor:
    """hasten.model.rope.apply_rope over the looked-up table rows, then index_copy_ into the caches."""
    from hasten.model.rope import apply_rope

    T = qkv.shape[0]
    D = qkv.shape[1] // (heads + 2 * kv_heads)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    qk = apply_rope(qkv[:, : (heads + kv_heads) * D].reshape(T, heads + kv_heads, D), c, s)
    v = qkv[:, (heads + kv_heads) * D :].reshape(T, kv_heads, D)
    kv_write_reference(qk[:, heads:], v, slots, k_cache, v_cache)
    return qk[:, :heads].contiguous()


def kv_write(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor) -> None:
    """Stores k and v [T, KVH, D] (any token / head strides, dim stride 1) at the flat cache slots
    `slots`, converted to the caches' dtype; rows with a negative slot store nothing."""
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must share a [T, KVH, D] shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    T, kvh, D = k.shape
    if k.dtype not in _FLOATS or v.dtype not in _FLOATS:
        raise ValueError(f"k and v must be float tensors, got {k.dtype} and {v.dtype}")
    if D > 1 and (k.stride(2) != 1 or v.stride(2) != 1):
        raise ValueError("k and v must be contiguous along head_dim")
    _check_caches(k_cache, v_cache, kvh, D)
    for t in (v, k_cache, v_cache):
        if t.device != k.device:
            raise ValueError(f"all tensors must be on {k.device}, found one on {t.device}")
    _check_index("slots", slots, T, k.device)
    if T == 0:
        return
    db = _pow2(D)
    hb = max(1, min(_pow2(kvh), 2048 // db))
    kv_write_kernel = _kernels()[2]
    kv_write_kernel[(T, _cdiv(kvh, hb))](
        k, v, slots, k_cache, v_cache, k.stride(0), k.stride(1), v.stride(0), v.stride(1), KV_HEADS=kvh, D=D,
        HB=hb, DB=db, num_warps=_warps(hb * db))


def kv_write_reference(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor) -> None:
    kvh, D = k.shape[1], k.shape[2]
    keep = slots >= 0
    flat_k, flat_v = k_cache.view(-1, kvh, D), v_cache.view(-1, kvh, D)
    flat_k.index_copy_(0, slots[keep], k[keep].to(flat_k.dtype))
    flat_v.index_copy_(0, slots[keep], v[keep].to(flat_v.dtype))


def _gated(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    _check_rows("gate_up", gate_up)
    T, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up must be [T, 2 * I], got an odd width {width}")
    inter = width // 2
    out = torch.empty((T, inter), dtype=gate_up.dtype, device=gate_up.device)
    if T == 0 or inter == 0:
        return out
    block = min(_pow2(inter), 1024)  # a grid over column blocks: any intermediate size
    gated_kernel = _kernels()[3]
    gated_kernel[(T, _cdiv(inter, block))](gate_up, out, gate_up.stride(0), out.stride(0), inter,
                                                   GELU=gelu, BLOCK=block, num_warps=_warps(block))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] [T, 2 I] (row stride free); returns [T, I]."""
    return _gated(gate_up, gelu=False)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[1] // 2
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate='tanh') * up (Gemma's MLP) for gate_up = [gate | up]; returns [T, I]."""
    return _gated(gate_up, gelu=True)


def gelu_tanh_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[1] // 2
    return F.gelu(gate_up[:, :inter], approximate="tanh") * gate_up[:, inter:]
