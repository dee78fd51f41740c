"""Paged attention in Triton: flash-decoding for decode steps, a varlen causal kernel for the rest.

Layout (the same as hasten/kernels/paged_attention_cpu.cpp):
    q            [T, H, D]                 new tokens of all sequences, sequence after sequence
    k/v_cache    [num_blocks, BS, KVH, D]  the block pool of one layer (new tokens already written);
                                           q's dtype, or float16 / bfloat16
    block_tables [S, W] int32              cache blocks of each sequence (entries past the used
                                           blocks are arbitrary)
    query_start  [S + 1] int64             rows of q owned by sequence s: query_start[s] .. [s+1]
    context_lens [S] int64                 tokens in the cache for s, counting its new tokens
Query i of a sequence with n new tokens and context c sits at position p = c - n + i and sees keys
0 .. p (causal); window > 0 keeps only p - window + 1 .. p; softcap > 0 replaces each scaled score
x by softcap * tanh(x / softcap). Query head h reads kv head h // (H // KVH) (MHA, GQA, MQA).
The result is [T, H * D] in q's dtype. A sequence without new tokens produces no rows; a sequence
with one row and context 0 (a padding slot of a captured CUDA graph) produces zeros.

Both kernels fold the G = H // KVH query heads of one kv head into the rows of the score tile, so
each key/value row is read once per program, and address keys token by token through the block
table (token t of sequence s lives at row t % BS of block block_tables[s, t // BS]), so any block
size works and no key is gathered into a padded copy. Scores, the softmax and the accumulator are
float32 with an online (running max, running sum) softmax; the matmul operands are cast to q's
dtype (float16 / bfloat16 tensor cores on a GPU, exact float32 products for float32 q).

Decode (max_query_len == 1): flash-decoding. The grid is (S, KVH, num_splits); split `sp` covers
the blocks [sp * chunk, (sp + 1) * chunk) of its sequence, chunk = cdiv(W, num_splits), clipped to
the context and to the window start. Each program writes its unnormalized accumulator, max and sum
to float32 scratch and a combine kernel (grid (S, H)) merges the splits by log-sum-exp. With one
split the decode kernel normalizes and writes the output itself. The grids depend on shapes only
(S, KVH, H, W, num_splits), never on the lengths, so a decode step can be captured in a CUDA graph.

Prefill, chunked prefill, mixed batches, speculative verify (max_query_len > 1): the grid is
(cdiv(max_query_len, BLOCK_Q), S, KVH); a program takes BLOCK_Q query rows of one sequence times
the G heads of one kv head and loops over keys from the window start of its first row to the
position of its last row, masking by absolute positions.

Both kernels walk their keys with one loop (_attend_span over _attend_tile). On a GPU it is a
`range` loop the compiler can pipeline; under the interpreter (TRITON_INTERPRET=1) a `while` loop,
because the interpreter cannot take loaded values as range() bounds.
"""

from __future__ import annotations

import functools

import torch

from hasten.kernels.triton import interpreting

# The jit helpers both attention kernels call, defined by _kernels(). They are module globals because
# the interpreter runs kernels against their module's globals (closure variables are not seen).
_attend_tile = None
_attend_span = None


@functools.cache
def _kernels():
    global _attend_tile, _attend_span
    import triton
    import triton.language as tl

    @triton.jit
    def attend_tile(q, m_i, l_i, acc, start, first, hi, pos, k_ptr, v_ptr, table_ptr,
                    stride_kb, stride_ks, stride_vb, stride_vs, scale, softcap, window,
                    D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
        """One online-softmax step of the rows of q (at positions pos) over keys start .. start + BLOCK_N
        (those in [first, hi) only). k_ptr / v_ptr point at the kv head, table_ptr at the sequence's table."""
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        t = start + offs_n
        t_ok = (t >= first) & (t < hi)
        blk = tl.load(table_ptr + t // BS, mask=t_ok, other=0).to(tl.int64)
        k_row = blk * stride_kb + (t % BS) * stride_ks
        v_row = blk * stride_vb + (t % BS) * stride_vs
        kt = tl.load(k_ptr + k_row[None, :] + offs_d[:, None], mask=t_ok[None, :] & d_ok[:, None], other=0.0)
        scores = tl.dot(q, kt.to(q.dtype), input_precision=PRECISION) * scale
        if HAS_SOFTCAP:  # softcap * tanh(x / softcap), tanh(y) = 1 - 2 / (exp(2y) + 1)
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        ok = t_ok[None, :] & (t[None, :] <= pos[:, None])
        if HAS_WINDOW:
            ok = ok & (t[None, :] > pos[:, None] - window)
        scores = tl.where(ok, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key yet
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + v_row[:, None] + offs_d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        return m_new, l_i, acc

    _attend_tile = attend_tile

    @triton.jit
    def attend_span(q, m_i, l_i, acc, lo, first, hi, pos, k_ptr, v_ptr, table_ptr,
                    stride_kb, stride_ks, stride_vb, stride_vs, scale, softcap, window,
                    D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
                    LOOP_WHILE: tl.constexpr):
        """attend_tile over the key tiles starting at lo, lo + BLOCK_N, ... below hi (keys in [first, hi))."""
        if LOOP_WHILE:  # the interpreter cannot take loaded values as range() bounds
            start = lo
            while start < hi:
                m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, start, first, hi, pos, k_ptr, v_ptr, table_ptr,
                                             stride_kb, stride_ks, stride_vb, stride_vs, scale, softcap, window,
                                             D, BS, BLOCK_N, BLOCK_D, HAS_WINDOW, HAS_SOFTCAP, PRECISION)
                start += BLOCK_N
        else:
            for start in range(lo, hi, BLOCK_N):
                m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, start, first, hi, pos, k_ptr, v_ptr, table_ptr,
                                             stride_kb, stride_ks, stride_vb, stride_vs, scale, softcap, window,
                                             D, BS, BLOCK_N, BLOCK_D, HAS_WINDOW, HAS_SOFTCAP, PRECISION)
        return m_i, l_i, acc

    _attend_span = attend_span

    @triton.jit
    def decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, qstart_ptr, ctx_ptr, out_ptr, acc_ptr, m_ptr, l_ptr,
                      scale, softcap, window, chunk_tokens,
                      stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                      stride_bt, stride_ot,
                      G: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                      NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                      PRECISION: tl.constexpr, LOOP_WHILE: tl.constexpr):
        s = tl.program_id(0).to(tl.int64)
        kh = tl.program_id(1).to(tl.int64)
        sp = tl.program_id(2).to(tl.int64)
        qs = tl.load(qstart_ptr + s).to(tl.int64)
        n = tl.load(qstart_ptr + s + 1).to(tl.int64) - qs
        ctx = tl.load(ctx_ptr + s).to(tl.int64)
        ctx = tl.where(n > 0, ctx, 0)  # no new token: nothing to attend
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        g_ok = offs_g < G
        d_ok = offs_d < D
        heads = kh * G + offs_g
        q = tl.load(q_ptr + qs * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :] & (n > 0), other=0.0)
        pos = tl.zeros([BLOCK_G], tl.int64) + (ctx - 1)
        # This split's keys: [first, hi), walked in tiles aligned to the split's start.
        split_lo = sp * chunk_tokens
        hi = tl.minimum(split_lo + chunk_tokens, ctx)
        first = split_lo + ctx * 0
        if HAS_WINDOW:
            first = tl.maximum(first, ctx - window)  # p - window + 1 with p = ctx - 1
        lo = split_lo + ((first - split_lo) // BLOCK_N) * BLOCK_N
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        k_base = k_ptr + kh * stride_kh
        v_base = v_ptr + kh * stride_vh
        table = tables_ptr + s * stride_bt
        m_i, l_i, acc = _attend_span(q, m_i, l_i, acc, lo, first, hi, pos, k_base, v_base, table,
                                     stride_kb, stride_ks, stride_vb, stride_vs, scale, softcap, window,
                                     D, BS, BLOCK_N, BLOCK_D, HAS_WINDOW, HAS_SOFTCAP, PRECISION, LOOP_WHILE)
        if NUM_SPLITS == 1:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + qs * stride_ot + heads[:, None] * D + offs_d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :] & (n > 0))
        else:
            part = (s * H + heads) * NUM_SPLITS + sp
            tl.store(acc_ptr + part[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
            tl.store(m_ptr + part, m_i, mask=g_ok)
            tl.store(l_ptr + part, l_i, mask=g_ok)

    @triton.jit
    def combine_kernel(qstart_ptr, out_ptr, acc_ptr, m_ptr, l_ptr, stride_ot,
                       H: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                       BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr):
        s = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        qs = tl.load(qstart_ptr + s).to(tl.int64)
        n = tl.load(qstart_ptr + s + 1).to(tl.int64) - qs
        offs_sp = tl.arange(0, BLOCK_SPLITS)
        offs_d = tl.arange(0, BLOCK_D)
        sp_ok = offs_sp < NUM_SPLITS
        d_ok = offs_d < D
        part = (s * H + h) * NUM_SPLITS + offs_sp
        m = tl.load(m_ptr + part, mask=sp_ok, other=float("-inf"))
        l_s = tl.load(l_ptr + part, mask=sp_ok, other=0.0)
        acc = tl.load(acc_ptr + part[:, None] * D + offs_d[None, :], mask=sp_ok[:, None] & d_ok[None, :], other=0.0)
        m_max = tl.max(m, 0)
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)  # no split saw a key: zeros
        w = tl.exp(m - m_safe)
        den = tl.sum(l_s * w, 0)
        o = tl.sum(acc * w[:, None], 0) / tl.where(den > 0, den, 1.0)
        tl.store(out_ptr + qs * stride_ot + h * D + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_ok & (n > 0))

    @triton.jit
    def prefill_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, qstart_ptr, ctx_ptr, out_ptr,
                       scale, softcap, window,
                       stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                       stride_bt, stride_ot,
                       G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_Q: tl.constexpr,
                       BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                       HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
                       LOOP_WHILE: tl.constexpr):
        tile = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1).to(tl.int64)
        kh = tl.program_id(2).to(tl.int64)
        qs = tl.load(qstart_ptr + s).to(tl.int64)
        n = tl.load(qstart_ptr + s + 1).to(tl.int64) - qs
        ctx = tl.load(ctx_ptr + s).to(tl.int64)
        # Row r of the tile is query token tile * BLOCK_Q + r // BLOCK_G, head kh * G + r % BLOCK_G.
        offs_r = tl.arange(0, BLOCK_Q * BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        i = tile * BLOCK_Q + offs_r // BLOCK_G
        g = offs_r % BLOCK_G
        r_ok = (i < n) & (g < G)
        d_ok = offs_d < D
        pos = ctx - n + i
        heads = kh * G + g
        q = tl.load(q_ptr + (qs + i)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        # Keys this tile can see: from the window start of its first row to its last row's position.
        first_i = tile * BLOCK_Q
        last_i = tl.minimum(first_i + BLOCK_Q, n) - 1
        hi = tl.where(first_i < n, ctx - n + last_i + 1, 0)
        lo = hi * 0
        if HAS_WINDOW:
            lo = tl.maximum(ctx - n + first_i - window + 1, 0)
            lo = (lo // BLOCK_N) * BLOCK_N
        m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
        k_base = k_ptr + kh * stride_kh
        v_base = v_ptr + kh * stride_vh
        table = tables_ptr + s * stride_bt
        m_i, l_i, acc = _attend_span(q, m_i, l_i, acc, lo, lo, hi, pos, k_base, v_base, table,
                                     stride_kb, stride_ks, stride_vb, stride_vs, scale, softcap, window,
                                     D, BS, BLOCK_N, BLOCK_D, HAS_WINDOW, HAS_SOFTCAP, PRECISION, LOOP_WHILE)
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (qs + i)[:, None] * stride_ot + heads[:, None] * D + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])

    return decode_kernel, combine_kernel, prefill_kernel


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def decode_splits(max_blocks_per_seq: int, num_seqs: int, num_kv_heads: int) -> int:
    """Splits along the sequence for a decode step: enough (sequence, kv head, split) programs to
    fill a large GPU (~256), at least 4 blocks per split, at most 32 splits. Depends on shapes only."""
    programs = max(1, num_seqs * num_kv_heads)
    if programs >= 256 or max_blocks_per_seq <= 4:
        return 1
    return max(1, min(32, -(-256 // programs), max_blocks_per_seq // 4))


def _precision(dtype: torch.dtype) -> str | None:
    """Exact float32 products for float32 q (no TF32); the default for 16-bit operands."""
    return "ieee" if dtype == torch.float32 else None


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start: torch.Tensor, context_lens: torch.Tensor, scale: float, *, max_query_len: int,
                    window: int = 0, softcap: float = 0.0, num_splits: int = 0,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of every new token over its sequence's cached keys/values (layout: module docstring).

    max_query_len: the most new tokens of any sequence (<= 1: the decode kernel, which reads only the
    first row of each sequence, so every sequence must have one new token or none). num_splits (decode
    only): splits along the sequence, 0 = decode_splits(W, S, KVH), clamped to 1 .. W.
    out: an optional [T, H * D] tensor to write into. Returns [T, H * D] in q's dtype.
    """
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"q must be [T, H, D] and the caches [blocks, BS, KVH, D], got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    T, H, D = q.shape
    _, BS, KVH, Dk = k_cache.shape
    if Dk != D or H % KVH:
        raise ValueError(f"head_dim {D} vs {Dk}, or {H} query heads not a multiple of {KVH} kv heads")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches' last dimension must be contiguous")
    S = context_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != S or query_start.shape[0] != S + 1:
        raise ValueError("block_tables must be [S, W] and query_start [S + 1] for S = len(context_lens)")
    if out is None:
        out = torch.empty((T, H * D), device=q.device, dtype=q.dtype)
    elif out.shape != (T, H * D) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{T}, {H * D}] with a contiguous last dimension, got {tuple(out.shape)}")
    if T == 0 or S == 0:
        return out
    q = q.contiguous()
    block_tables = block_tables.contiguous()
    query_start = query_start.contiguous()
    context_lens = context_lens.contiguous()
    G = H // KVH
    W = block_tables.shape[1]
    block_d = max(16, _pow2(D))
    common = dict(G=G, D=D, BS=BS, BLOCK_D=block_d, HAS_WINDOW=window > 0, HAS_SOFTCAP=softcap > 0,
                  PRECISION=_precision(q.dtype), LOOP_WHILE=interpreting())
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0))
    decode_kernel, combine_kernel, prefill_kernel = _kernels()
    softcap_arg = float(softcap) if softcap > 0 else 1.0
    window_arg = int(window) if window > 0 else 1
    if max_query_len <= 1:
        splits = num_splits if num_splits > 0 else decode_splits(W, S, KVH)
        splits = max(1, min(splits, W))
        chunk_tokens = -(-W // splits) * BS
        block_n = min(64 if block_d <= 128 else 32, max(16, _pow2(chunk_tokens)))
        if splits > 1:
            acc = torch.empty((S, H, splits, D), device=q.device, dtype=torch.float32)
            m = torch.empty((S, H, splits), device=q.device, dtype=torch.float32)
            lsum = torch.empty_like(m)
        else:
            acc = m = lsum = out  # unused: the decode kernel writes the output itself
        decode_kernel[(S, KVH, splits)](q, k_cache, v_cache, block_tables, query_start, context_lens, out,
                                        acc, m, lsum, float(scale), softcap_arg, window_arg, chunk_tokens,
                                        *strides, H=H, NUM_SPLITS=splits, BLOCK_G=max(16, _pow2(G)),
                                        BLOCK_N=block_n, num_warps=4, **common)
        if splits > 1:
            combine_kernel[(S, H)](query_start, out, acc, m, lsum, out.stride(0), H=H, D=D, NUM_SPLITS=splits,
                                   BLOCK_SPLITS=_pow2(splits), BLOCK_D=block_d, num_warps=4)
        return out
    block_g = _pow2(G)
    rows = 64 if block_d <= 128 else 32
    block_q = min(max(1, rows // block_g), _pow2(max_query_len))
    block_q = max(block_q, -(-16 // block_g))  # tl.dot needs at least 16 rows
    grid = (-(-max_query_len // block_q), S, KVH)
    prefill_kernel[grid](q, k_cache, v_cache, block_tables, query_start, context_lens, out,
                         float(scale), softcap_arg, window_arg, *strides, BLOCK_Q=block_q, BLOCK_G=block_g,
                         BLOCK_N=64 if block_d <= 128 else 32, num_warps=4 if block_d <= 64 else 8, **common)
    return out


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, query_start: torch.Tensor, context_lens: torch.Tensor,
                              scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """The same attention in plain PyTorch (float64): per sequence, keys/values gathered through the
    block table and an explicit causal / window mask. Rows with no visible key are zeros."""
    T, H, D = q.shape
    BS, KVH = k_cache.shape[1], k_cache.shape[2]
    G = H // KVH
    out = torch.zeros((T, H, D), dtype=torch.float64, device=q.device)
    for s in range(context_lens.shape[0]):
        q0, q1, c = int(query_start[s]), int(query_start[s + 1]), int(context_lens[s])
        n = q1 - q0
        if n == 0 or c == 0:
            continue
        t = torch.arange(c, device=q.device)
        blocks = block_tables[s].long()[t // BS]
        k = k_cache[blocks, t % BS].double().repeat_interleave(G, dim=1)  # [c, H, D]
        v = v_cache[blocks, t % BS].double().repeat_interleave(G, dim=1)
        x = torch.einsum("nhd,chd->hnc", q[q0:q1].double(), k) * scale
        if softcap > 0:
            x = softcap * torch.tanh(x / softcap)
        pos = c - n + torch.arange(n, device=q.device)
        mask = t[None, :] <= pos[:, None]
        if window > 0:
            mask &= t[None, :] > pos[:, None] - window
        x = x.masked_fill(~mask, float("-inf"))
        p = torch.softmax(x, dim=-1).nan_to_num(0.0)  # rows with no key: zeros
        out[q0:q1] = torch.einsum("hnc,chd->nhd", p, v)
    return out.reshape(T, H * D).to(q.dtype)


__all__ = ["decode_splits", "paged_attention", "paged_attention_reference"]
