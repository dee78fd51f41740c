"""Sliding-window and soft-capped attention: the C++ kernel and the SDPA path against a plain PyTorch
reference on fresh random inputs (decode and prefill rows, windows smaller and larger than the context)."""

from __future__ import annotations

import pytest
import torch

from hasten.kernels import cpu_attention
from hasten.model import layers
from tests.engine.test_attention_kernel import make_inputs

needs_kernel = pytest.mark.skipif(cpu_attention.load() is None, reason="C++ kernel cannot be built here")


def reference(q, k_cache, v_cache, tables, query_start, context_lens, scale, window=0, softcap=0.0):
    """Per sequence in float64: query at position p sees keys max(0, p - window + 1) .. p."""
    t, h, d = q.shape
    kvh, bs = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty(t, h * d, dtype=torch.float64)
    for s in range(len(context_lens)):
        a, b, c = int(query_start[s]), int(query_start[s + 1]), int(context_lens[s])
        n = b - a
        if n == 0:
            continue
        blocks = tables[s, : -(-c // bs)].long()
        k = k_cache[blocks].reshape(-1, kvh, d)[:c].double().repeat_interleave(h // kvh, 1)
        v = v_cache[blocks].reshape(-1, kvh, d)[:c].double().repeat_interleave(h // kvh, 1)
        scores = torch.einsum("thd,khd->htk", q[a:b].double(), k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        pos = torch.arange(c - n, c).view(1, n, 1)
        key = torch.arange(c).view(1, 1, c)
        hidden = key > pos
        if window:
            hidden = hidden | (key <= pos - window)
        scores = scores.masked_fill(hidden, float("-inf"))
        out[a:b] = torch.einsum("htk,khd->thd", scores.softmax(-1), v).reshape(n, h * d)
    return out


CASES = [
    # ctx, new tokens per sequence, heads, kv heads, head_dim, block size, window
    ([37, 100, 16, 17, 250], [1, 1, 1, 1, 1], 8, 2, 64, 16, 20),  # decode rows, window inside and past the context
    ([100, 64, 9, 300], [100, 3, 9, 40], 9, 3, 64, 16, 33),  # prefill, spec verify, chunked prefill
    ([130, 40], [130, 1], 4, 4, 16, 8, 8),  # window of one block, MHA
    ([90, 12], [31, 12], 6, 2, 32, 16, 500),  # window larger than every context: plain causal
    ([70, 45], [70, 1], 6, 2, 20, 16, 13),  # head_dim not a multiple of 8: portable path
    ([65], [65], 4, 1, 64, 16, 1),  # window 1: each token sees itself only
]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
@pytest.mark.parametrize("softcap", [0.0, 2.5])
def test_kernel_window_and_softcap_match_reference(case, dtype, softcap):
    *shape, window = case
    gen = torch.Generator().manual_seed(hash((tuple(shape[0]), window)) % 2**31)
    q, kc, vc, tables, qs, ctx = make_inputs(gen, *shape, dtype)
    scale = shape[4] ** -0.5
    out = cpu_attention.paged_attention(q, kc, vc, tables, qs, ctx, scale, window=window, softcap=softcap)
    ref = reference(q, kc, vc, tables, qs, ctx, scale, window, softcap)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@needs_kernel
def test_window_changes_the_result_and_float16_cache_reads_in_place():
    gen = torch.Generator().manual_seed(7)
    q, kc, vc, tables, qs, ctx = make_inputs(gen, [120, 80], [40, 1], 8, 2, 64, 16, torch.float32)
    full = cpu_attention.paged_attention(q, kc, vc, tables, qs, ctx, 0.125)
    windowed = cpu_attention.paged_attention(q, kc, vc, tables, qs, ctx, 0.125, window=24)
    assert not torch.allclose(full, windowed, atol=1e-3)
    half = cpu_attention.paged_attention(q, kc.half(), vc.half(), tables, qs, ctx, 0.125, window=24)
    ref = reference(q, kc.half().float(), vc.half().float(), tables, qs, ctx, 0.125, 24)
    torch.testing.assert_close(half.double(), ref, atol=1e-4, rtol=1e-4)


@needs_kernel
def test_window_turns_prefix_groups_off_without_changing_results():
    """Decode rows sharing prefix blocks are grouped when there is no window; under a window each
    row must still see exactly its own last `window` keys."""
    gen = torch.Generator().manual_seed(11)
    bs, kvh, d = 16, 2, 64
    kc = torch.randn(40, bs, kvh, d, generator=gen)
    vc = torch.randn(40, bs, kvh, d, generator=gen)
    shared = [1, 2, 3, 4]
    tables = torch.tensor([shared + [10 + i, 20 + i] for i in range(6)], dtype=torch.int32)
    ctx = torch.tensor([70, 75, 80, 90, 95, 70])
    qs = torch.arange(7)
    q = torch.randn(6, 8, d, generator=gen)
    for window in (0, 30):
        out = cpu_attention.paged_attention(q, kc, vc, tables, qs, ctx, 0.125, max_group=8, window=window)
        ref = reference(q, kc, vc, tables, qs, ctx, 0.125, window)
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


def padded_metadata(ctx: list[int], new: list[int], tables: torch.Tensor, block_size: int) -> layers.AttentionMetadata:
    """The SDPA layout the model runner builds: one padded group per kind of row (decode, prefill)."""
    groups = []
    rows = [0]
    for n in new:
        rows.append(rows[-1] + n)
    for sel in ([i for i, n in enumerate(new) if n == 1], [i for i, n in enumerate(new) if n > 1]):
        if not sel:
            continue
        b, lq = len(sel), max(new[i] for i in sel)
        lk = tables.shape[1] * block_size
        starts = torch.tensor([ctx[i] - new[i] for i in sel]).view(b, 1)
        lens = torch.tensor([new[i] for i in sel]).view(b, 1)
        q_off = torch.arange(lq).view(1, lq)
        valid = q_off < lens
        key = torch.arange(lk)
        if lq == 1:
            mask = key.view(1, 1, 1, lk) < torch.tensor([ctx[i] for i in sel]).view(b, 1, 1, 1)
        else:
            mask = key.view(1, 1, 1, lk) <= (starts + q_off).view(b, 1, lq, 1)
            mask = mask | (~valid).view(b, 1, lq, 1) & (key.view(1, 1, 1, lk) == 0)
        row = torch.tensor([rows[i] for i in sel]).view(b, 1)
        token_index = torch.where(valid, row + q_off, row)
        flat_valid = valid.view(-1).nonzero().squeeze(1)
        groups.append(layers.AttentionGroup(token_index=token_index, block_tables=tables[sel].long(), mask=mask,
                                            flat_valid_index=flat_valid, flat_token_index=token_index.view(-1)[flat_valid]))
    return layers.AttentionMetadata(slot_mapping=torch.zeros(rows[-1], dtype=torch.long), groups=groups)


@pytest.mark.parametrize("softcap", [0.0, 2.5])
@pytest.mark.parametrize("window", [0, 10, 1000])
def test_sdpa_path_window_and_softcap_match_reference(window, softcap):
    gen = torch.Generator().manual_seed(5)
    ctx, new = [50, 33, 70, 20], [1, 33, 12, 1]
    q, kc, vc, tables, qs, ctx_t = make_inputs(gen, ctx, new, 8, 2, 32, 8, torch.float32)
    meta = padded_metadata(ctx, new, tables, 8)
    out = layers.paged_attention(q, kc, vc, meta, 2, 0.2, window=window, softcap=softcap)
    ref = reference(q, kc, vc, tables, qs, ctx_t, 0.2, window, softcap)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
