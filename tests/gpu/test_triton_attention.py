"""The Triton paged-attention kernels against their PyTorch reference (on the CPU: in Triton's interpreter).

Every test draws fresh random inputs; the seed is in each assertion message. Outputs are poisoned
with NaN before the call, so a row the kernel forgets to write fails the comparison.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import hasten.kernels.triton as hk
from hasten.kernels.triton import attention as ta

DEVICE = "cuda" if hk.usable_on("cuda") else "cpu"
pytestmark = pytest.mark.skipif(not hk.usable_on(DEVICE), reason=hk.unusable_reason(DEVICE))

TOL = {torch.float32: 1e-4, torch.float16: 2e-3}


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def make_batch(seed: int, seqs: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, block_size: int = 16,
               dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None, shared_prefix: int = 0,
               q_scale: float = 1.0) -> dict:
    """A batch of sequences given as (new tokens n, context c) over a shuffled block pool.

    shared_prefix > 0: every table starts with the same `shared_prefix` blocks (those of sequence 0).
    Table entries past a sequence's used blocks are random valid block ids."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(c / block_size) for _, c in seqs]
    width = max(need + [1]) + 1
    num_blocks = sum(need) + 4
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(seqs), width), generator=gen, dtype=torch.int32)
    used = 0
    for s, nb in enumerate(need):
        tables[s, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
    if shared_prefix:
        for s in range(1, len(seqs)):
            assert need[s] >= shared_prefix and need[0] >= shared_prefix
            tables[s, :shared_prefix] = tables[0, :shared_prefix]
    kv_dtype = kv_dtype or dtype
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(kv_dtype)
    v_cache = torch.randn(shape, generator=gen).to(kv_dtype)
    query_start = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    query_start[1:] = torch.tensor([n for n, _ in seqs], dtype=torch.int64).cumsum(0)
    total = int(query_start[-1])
    q = (torch.randn((total, heads, head_dim), generator=gen) * q_scale).to(dtype)
    context_lens = torch.tensor([c for _, c in seqs], dtype=torch.int64)
    batch = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, query_start=query_start,
                 context_lens=context_lens)
    return {key: value.to(DEVICE) for key, value in batch.items()}


def run_and_check(seed: int, batch: dict, *, max_query_len: int, window: int = 0, softcap: float = 0.0,
                  num_splits: int = 0, tol: float | None = None) -> torch.Tensor:
    q = batch["q"]
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = torch.full((q.shape[0], q.shape[1] * q.shape[2]), float("nan"), dtype=q.dtype, device=q.device)
    got = ta.paged_attention(**batch, scale=scale, max_query_len=max_query_len, window=window, softcap=softcap,
                             num_splits=num_splits, out=out)
    assert got.data_ptr() == out.data_ptr()
    want = ta.paged_attention_reference(**batch, scale=scale, window=window, softcap=softcap)
    tol = tol if tol is not None else TOL[q.dtype]
    assert torch.isfinite(got).all(), f"seed {seed}: non-finite output rows"
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    assert torch.allclose(got.double(), want.double(), rtol=tol, atol=tol), f"seed {seed}: max error {err}"
    return got


HEADS = [(4, 4, 64), (8, 2, 128), (4, 1, 64), (6, 2, 96)]  # MHA, GQA, MQA, GQA with G = 3 and D = 96


@pytest.mark.parametrize("heads,kv_heads,head_dim", HEADS)
def test_decode(heads: int, kv_heads: int, head_dim: int) -> None:
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    contexts = [1, 16, 17] + torch.randint(2, 100, (3,), generator=gen).tolist()
    batch = make_batch(seed, [(1, c) for c in contexts], heads, kv_heads, head_dim)
    one = run_and_check(seed, batch, max_query_len=1, num_splits=1)
    several = run_and_check(seed, batch, max_query_len=1, num_splits=3)
    assert torch.allclose(one, several, rtol=1e-5, atol=1e-5), f"seed {seed}: splits 1 vs 3 differ"
    run_and_check(seed, batch, max_query_len=1)  # the heuristic's choice


@pytest.mark.parametrize("heads,kv_heads,head_dim", HEADS)
def test_prefill(heads: int, kv_heads: int, head_dim: int) -> None:
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    lens = [1, 17] + torch.randint(2, 40, (2,), generator=gen).tolist()
    batch = make_batch(seed, [(n, n) for n in lens], heads, kv_heads, head_dim, block_size=8)
    run_and_check(seed, batch, max_query_len=max(lens))


def test_chunked_prefill_over_cached_prefix() -> None:
    seed = _seed()
    batch = make_batch(seed, [(20, 70), (5, 37), (33, 33)], 8, 2, 64, block_size=8)
    run_and_check(seed, batch, max_query_len=33)


def test_mixed_batch() -> None:
    """Decode rows, a prefill, a speculative verify (n = 3), a chunk over a cached prefix, a sequence
    without new tokens and a padding slot (context 0), in one call of the prefill kernel."""
    seed = _seed()
    seqs = [(1, 33), (24, 24), (3, 50), (0, 40), (10, 61), (1, 1), (1, 0)]
    batch = make_batch(seed, seqs, 4, 2, 64)
    got = run_and_check(seed, batch, max_query_len=24)
    assert (got[-1] == 0).all(), f"seed {seed}: the padding slot is not zeros"


def test_shared_prefix_blocks() -> None:
    seed = _seed()
    seqs = [(1, 45), (1, 40), (1, 70)]
    batch = make_batch(seed, seqs, 4, 2, 64, shared_prefix=2)
    run_and_check(seed, batch, max_query_len=1, num_splits=2)
    seqs = [(12, 45), (6, 40), (30, 70)]
    batch = make_batch(seed, seqs, 4, 2, 64, shared_prefix=2)
    run_and_check(seed, batch, max_query_len=30)


@pytest.mark.parametrize("decode", [True, False])
def test_window_and_softcap(decode: bool) -> None:
    seed = _seed()
    seqs = [(1, 9), (1, 40), (1, 97)] if decode else [(30, 30), (6, 77), (1, 50)]
    batch = make_batch(seed, seqs, 4, 2, 64, q_scale=4.0)
    mql = 1 if decode else 30
    for window, softcap in [(13, 0.0), (0, 5.0), (20, 5.0)]:
        got = run_and_check(seed, batch, max_query_len=mql, window=window, softcap=softcap, num_splits=3)
        if decode:
            one = run_and_check(seed, batch, max_query_len=mql, window=window, softcap=softcap, num_splits=1)
            assert torch.allclose(one, got, rtol=1e-5, atol=1e-5), f"seed {seed}: splits 1 vs 3 differ"


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float16, torch.float16), (torch.float32, torch.float16)])
def test_half_precision(dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    seed = _seed()
    decode = make_batch(seed, [(1, 20), (1, 64), (1, 90)], 8, 2, 128, dtype=dtype, kv_dtype=kv_dtype)
    run_and_check(seed, decode, max_query_len=1, num_splits=2, tol=TOL[torch.float16])
    prefill = make_batch(seed, [(16, 40), (3, 3)], 8, 2, 128, block_size=8, dtype=dtype, kv_dtype=kv_dtype)
    run_and_check(seed, prefill, max_query_len=16, tol=TOL[torch.float16])


@pytest.mark.parametrize("num_splits", [1, 4])
def test_padded_decode(num_splits: int) -> None:
    """CUDA-graph padding: slots with context 0 (one row, zeros out) and sequences without rows."""
    seed = _seed()
    seqs = [(1, 30), (1, 0), (0, 12), (1, 5), (1, 0)]
    batch = make_batch(seed, seqs, 4, 2, 64)
    got = run_and_check(seed, batch, max_query_len=1, num_splits=num_splits)
    assert got.shape == (4, 4 * 64)
    assert (got[1] == 0).all() and (got[3] == 0).all(), f"seed {seed}: padding slots are not zeros"


def test_defaults_and_errors() -> None:
    seed = _seed()
    batch = make_batch(seed, [(1, 10), (1, 20)], 4, 2, 64)
    scale = 0.125
    got = ta.paged_attention(**batch, scale=scale, max_query_len=1)
    want = ta.paged_attention_reference(**batch, scale=scale)
    assert got.shape == (2, 256) and torch.allclose(got, want, rtol=1e-4, atol=1e-4), f"seed {seed}"
    with pytest.raises(ValueError):
        ta.paged_attention(**batch, scale=scale, max_query_len=1, out=torch.empty(2, 128))
    empty = make_batch(seed, [(0, 5)], 4, 2, 64)
    assert ta.paged_attention(**empty, scale=scale, max_query_len=0).shape == (0, 256)


def test_decode_splits_heuristic() -> None:
    assert ta.decode_splits(4, 1, 1) == 1  # too few blocks to split
    assert ta.decode_splits(2048, 512, 8) == 1  # enough programs already
    many = ta.decode_splits(2048, 1, 8)
    assert 1 < many <= 32
    assert ta.decode_splits(16, 1, 1) <= 16 // 4
