"""Building blocks of the decoder: norms, paged attention on CPU (rotary embeddings: hasten/model/rope.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hasten.kernels import cpu_attention
from hasten.model.rope import RotaryEmbedding, apply_rope

__all__ = ["AttentionGroup", "AttentionMetadata", "RotaryEmbedding", "apply_rope", "paged_attention", "rms_norm",
           "resolve_attention_backend", "single_sequence_metadata"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, in the same order as Hugging Face."""
    dtype = x.dtype
    if dtype == torch.float32:  # one fused op, bit-identical to the steps below in float32
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


@dataclass
class AttentionGroup:
    """Sequences attended together in one padded SDPA call.

    token_index: [B, Lq] rows of the flat token batch (padding repeats a valid row)
    block_tables: [B, max_blocks] cache blocks of each sequence
    mask: [B, 1, Lq, Lk] boolean, True where a query may see a key (None: no masking needed).
    Each row of the causal mask is a prefix of the keys (query at position p: keys 0 .. p; a padded
    query row: some prefix too), which is how window_mask() finds each query's position.
    """

    token_index: torch.Tensor
    block_tables: torch.Tensor
    mask: torch.Tensor | None
    flat_valid_index: torch.Tensor  # positions in the [B*Lq] padded layout that hold real tokens
    flat_token_index: torch.Tensor  # the flat-batch rows those real tokens belong to
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)  # window -> mask, per step

    def window_mask(self, window: int, lk: int) -> torch.Tensor:
        """The causal mask narrowed to each query's last `window` keys (built once per step and window)."""
        mask = self.window_masks.get(window)
        if mask is None:
            b, lq = self.token_index.shape
            causal = self.mask if self.mask is not None else torch.ones(b, 1, 1, lk, dtype=torch.bool)
            query_pos = causal.sum(-1, keepdim=True) - 1
            mask = causal & (torch.arange(lk).view(1, 1, 1, lk) > query_pos - window)
            self.window_masks[window] = mask
        return mask


@dataclass
class AttentionMetadata:
    """Where each new token goes in the cache and what it attends to.

    Two layouts: `groups` for the padded SDPA path, or the flat (block_tables, query_start,
    context_lens) triple read in place by the C++ kernel (kernel="cpp") or the Triton kernels
    (kernel="triton", hasten/kernels/triton/attention.py).
    """

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    groups: list[AttentionGroup] = field(default_factory=list)
    block_tables: torch.Tensor | None = None  # [S, max_blocks] int32 (kernel path)
    query_start: torch.Tensor | None = None  # [S + 1] int64: q rows of sequence s are [s] .. [s + 1]
    context_lens: torch.Tensor | None = None  # [S] int64: cached tokens of s, counting its new ones
    kernel: str = "cpp"  # which kernel reads the flat layout: cpp | triton
    max_query_len: int = 0  # triton: the most new tokens of any sequence (1: the decode kernel)
    decode_splits: int = 0  # triton decode: splits along the sequence (0: the kernel's choice)


def rows_metadata(meta: AttentionMetadata, rows: torch.Tensor) -> AttentionMetadata:
    """The flat metadata of some rows of `meta`'s sequences (int64 `rows`, ascending), each row as a
    one-token sequence that sees its own sequence's keys up to its own position: what the last layer
    attends with when only the sampled rows go on (Decoder.forward's out_rows)."""
    qs = meta.query_start
    seq = torch.searchsorted(qs, rows, right=True) - 1
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[rows],
        block_tables=meta.block_tables[seq].contiguous(),
        query_start=torch.arange(rows.numel() + 1, dtype=torch.long),
        context_lens=meta.context_lens[seq] - (qs[seq + 1] - rows) + 1,
        kernel=meta.kernel,
        max_query_len=1,
    )


ATTENTION_BACKENDS = ("auto", "cpp", "sdpa", "triton")


def resolve_attention_backend(name: str, device: str | torch.device = "cpu") -> str:
    """"cpp" (the in-place C++ kernel), "sdpa" (gather + scaled_dot_product_attention) or "triton"
    (the GPU path's kernels; on the CPU only in Triton's interpreter).

    auto picks triton on a GPU, else cpp when the kernel can be built on this machine; cpp insists on it.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    on_cpu = torch.device(device).type == "cpu"
    if name == "triton" or (name == "auto" and not on_cpu):
        from hasten.kernels import triton as triton_kernels

        if not triton_kernels.usable_on(device):
            raise RuntimeError(f"attention_backend='triton' cannot run here: {triton_kernels.unusable_reason(device)}")
        return "triton"
    if name == "sdpa":
        return "sdpa"
    if not on_cpu:
        raise ValueError(f"attention_backend='cpp' is the CPU kernel; on {device} use triton or sdpa")
    if cpu_attention.load() is not None:
        return "cpp"
    if name == "cpp":
        raise RuntimeError(f"attention_backend='cpp' but the kernel cannot be built: {cpu_attention.load_error()}")
    return "sdpa"


def single_sequence_metadata(num_tokens: int, block_size: int, backend: str) -> AttentionMetadata:
    """Metadata for one causal prefill of `num_tokens` tokens held in blocks 0, 1, 2, ..."""
    nblocks = -(-num_tokens // block_size)
    pos = torch.arange(num_tokens)
    tables = torch.arange(nblocks).view(1, nblocks)
    if backend in ("cpp", "triton"):
        return AttentionMetadata(
            slot_mapping=pos,
            block_tables=tables.to(torch.int32),
            query_start=torch.tensor([0, num_tokens]),
            context_lens=torch.tensor([num_tokens]),
            kernel=backend,
            max_query_len=num_tokens,
        )
    lk = nblocks * block_size
    mask = torch.arange(lk).view(1, 1, 1, lk) <= pos.view(1, 1, num_tokens, 1)
    group = AttentionGroup(
        token_index=pos.view(1, num_tokens),
        block_tables=tables,
        mask=mask,
        flat_valid_index=pos.clone(),
        flat_token_index=pos.clone(),
    )
    return AttentionMetadata(slot_mapping=pos, groups=[group])


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    num_kv_heads: int,
    scale: float,
    max_group: int = 8,
    window: int = 0,
    softcap: float = 0.0,
    wide_rows: int = 0,
    int8_rows: int = 0,
    int8_bf16_pv: bool = False,
    int8_tiles: bool = False,
    int8_decode: bool = False,
    lane_tokens: int = 0,
    spread_prefetch: bool = True,
) -> torch.Tensor:
    """Attention of every new token over its sequence's cached keys/values.

    q: [T, H, D]; caches: [num_blocks, block_size, KVH, D] (already holding the new tokens).
    Query heads that share a KV head are folded into the query length, so GQA needs no
    repeated keys. window > 0: a query at position p sees keys p - window + 1 .. p only (sliding
    window). softcap > 0: scores x (already scaled) become softcap * tanh(x / softcap). Returns [T, H*D].
    wide_rows > 0 (C++ kernel only): sequences with that many new tokens attend in bfloat16 SDPA;
    int8_rows > 0 (C++ kernel, int8 cache): those score in int8 (cpu_attention.paged_attention), and with
    int8_bf16_pv take P V in bfloat16; int8_tiles: both on AMX tiles; int8_decode (C++ kernel, int8 cache):
    the other sequences (decodes, shorter chunks) score in int8 over the key codes read in place; lane_tokens
    (C++ kernel, a narrower cache): tiles of that many new tokens or more with the query rows in the lanes;
    spread_prefetch (C++ kernel): the block ahead requested a few lines per step rather than in one burst.
    """
    if meta.block_tables is not None and meta.kernel == "triton":
        from hasten.kernels.triton import attention as triton_attention

        return triton_attention.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start,
                                                meta.context_lens, scale, max_query_len=meta.max_query_len,
                                                window=window, softcap=softcap, num_splits=meta.decode_splits)
    if meta.block_tables is not None:
        return cpu_attention.paged_attention(q.contiguous(), k_cache, v_cache, meta.block_tables, meta.query_start,
                                             meta.context_lens, scale, max_group=max_group, window=window,
                                             softcap=softcap, wide_rows=wide_rows, int8_rows=int8_rows,
                                             int8_bf16_pv=int8_bf16_pv, int8_tiles=int8_tiles,
                                             int8_decode=int8_decode, lane_tokens=lane_tokens,
                                             spread_prefetch=spread_prefetch)
    t_total, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    out = q.new_empty(t_total, num_heads * head_dim)
    for g in meta.groups:
        b, lq = g.token_index.shape
        flat_tables = g.block_tables.view(-1)
        lk = g.block_tables.shape[1] * k_cache.shape[1]
        k = k_cache.index_select(0, flat_tables).to(q.dtype)  # [B*nb, bs, KVH, D]
        v = v_cache.index_select(0, flat_tables).to(q.dtype)
        k = k.view(b, lk, num_kv_heads, head_dim).transpose(1, 2)
        v = v.view(b, lk, num_kv_heads, head_dim).transpose(1, 2)
        qg = q.index_select(0, g.token_index.view(-1)).view(b, lq, num_heads, head_dim)
        qg = qg.view(b, lq, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        qg = qg.reshape(b, num_kv_heads, group * lq, head_dim)
        mask = g.window_mask(window, lk) if window > 0 else g.mask
        if mask is not None and group > 1 and lq > 1:
            mask = mask.repeat(1, 1, group, 1)
        if softcap > 0:  # SDPA has no soft cap: the scores spelled out, as transformers' eager path
            scores = torch.tanh(torch.matmul(qg, k.transpose(-1, -2)) * scale / softcap) * softcap
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            o = torch.matmul(scores.softmax(-1), v)
        else:
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
        o = o.view(b, num_kv_heads, group, lq, head_dim).permute(0, 3, 1, 2, 4).reshape(b * lq, -1)
        if lq == 1:
            out[g.token_index.view(-1)] = o
        else:
            out[g.flat_token_index] = o[g.flat_valid_index]
    return out
