"""Read GGUF Q4_0 / Q4_1 / Q8_0 blocks straight into our INT4 / INT8 layouts (no float round trip).

Block formats (32 weights each, ggml):
  Q4_0: fp16 d, 16 bytes of nibbles          -> w = (q - 8) * d
  Q4_1: fp16 d, fp16 m, 16 bytes of nibbles  -> w = q * d + m
  Q8_0: fp16 d, 32 int8                      -> w = q * d
Nibble j of byte i (low first) holds element i + 16 * j of the block. Q4_0/Q4_1 become an
`Int4Weight` with group 32 exactly (scale d, min m or -8 d). Q8_0 is group-32 int8, which the
per-channel int8 kernel cannot express, so its integer values are re-scaled per output row:
q' = round(q * d_group / s_row) with s_row = max |w| / 127 (the one requantization).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from hasten.model.linear import DenseLinear, LinearLayer
from hasten.quant.formats import Int4Weight, Int8Weight, QuantizedWeight, pack_nibbles, quantize_int8

logger = logging.getLogger(__name__)

BLOCK = 32
NATIVE_TYPES = ("Q4_0", "Q4_1", "Q8_0")
FLOAT_TYPES = ("F32", "F16", "BF16")


def _f16(raw: np.ndarray) -> torch.Tensor:
    """uint8 [..., 2] little-endian halves -> float32 [...]."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def _nibble_codes(qs: np.ndarray) -> torch.Tensor:
    """uint8 [N, B, 16] ggml nibbles -> codes uint8 [N, B * 32] in element order."""
    q = torch.from_numpy(np.ascontiguousarray(qs))
    codes = torch.cat((q & 0x0F, q >> 4), dim=-1)  # element i from low nibble, i + 16 from high
    return codes.reshape(q.shape[0], -1)


def q4_blocks_to_int4(data: np.ndarray, kind: str, n: int, k: int) -> Int4Weight:
    """GGUF Q4_0/Q4_1 row data uint8 [N, bytes] -> Int4Weight group 32."""
    nb = k // BLOCK
    size = 18 if kind == "Q4_0" else 20
    blocks = np.asarray(data, dtype=np.uint8).reshape(n, nb, size)
    d = _f16(blocks[..., 0:2])
    if kind == "Q4_0":
        mins = -8.0 * d
        qs = blocks[..., 2:18]
    else:
        mins = _f16(blocks[..., 2:4])
        qs = blocks[..., 4:20]
    codes = _nibble_codes(qs)
    return Int4Weight(pack_nibbles(codes), d.contiguous(), mins.contiguous(), BLOCK)


def q8_blocks_to_int8(data: np.ndarray, n: int, k: int) -> Int8Weight:
    """GGUF Q8_0 row data -> per-channel Int8Weight (integer rescale per row, see module doc)."""
    nb = k // BLOCK
    blocks = np.asarray(data, dtype=np.uint8).reshape(n, nb, 34)
    d = _f16(blocks[..., 0:2])  # [N, nb]
    q = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:34]).view(np.int8)).float()  # [N, nb, 32]
    row_max = (q.abs().amax(-1) * d.abs()).amax(-1)  # max |w| per row
    s_row = (row_max / 127.0).clamp(min=1e-10)
    ratio = (d / s_row[:, None])[..., None]  # [N, nb, 1]
    q_new = torch.round(q * ratio).clamp_(-127, 127).to(torch.int8).reshape(n, k)
    return Int8Weight(q_new.contiguous(), s_row.contiguous())


def _unpermute_rows(qw: QuantizedWeight, heads: int) -> QuantizedWeight:
    """llama.cpp permutes q/k rows for its RoPE; rows are whole, so permute codes and scales alike."""
    def perm(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[0]
        hd = n // heads
        return t.reshape(heads, hd // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()

    if isinstance(qw, Int4Weight):
        return Int4Weight(perm(qw.qweight), perm(qw.scales), perm(qw.mins), qw.group_size)
    return Int8Weight(perm(qw.qweight), perm(qw.scales))


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    first = parts[0]
    if isinstance(first, Int4Weight):
        return Int4Weight(
            torch.cat([p.qweight for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat([p.mins for p in parts]),
            first.group_size,
        )
    return Int8Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]))


_PARTS = {
    "qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "o_proj": ("attn_output",),
    "gate_up_proj": ("ffn_gate", "ffn_up"),
    "down_proj": ("ffn_down",),
}


class GGUFLinearFactory:
    """LinearFactory serving each projection from the GGUF's own blocks where they are native."""

    def __init__(
        self, gguf_path: Path, max_kernel_rows: int = 32, quantize_lm_head: bool = True, int4_kernel: str = "auto",
        int8_kernel: str = "auto", q8_gemm: bool = True,
    ):
        from gguf import GGUFReader

        from hasten.model.loader import gguf_to_hf_config

        self.path = gguf_path
        self.reader = GGUFReader(str(gguf_path))
        self.tensors = {t.name: t for t in self.reader.tensors}
        cfg = gguf_to_hf_config(self.reader)
        self.arch = cfg["model_type"]
        self.heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
        self.max_kernel_rows = max_kernel_rows
        self.int4_kernel = int4_kernel
        self.int8_kernel = int8_kernel
        self.q8_gemm = q8_gemm
        self.quantize_lm_head = quantize_lm_head
        self.report: dict[str, str] = {}  # layer name -> how it was served

    def gguf_names(self, name: str) -> list[str]:
        if name == "lm_head":
            return ["output.weight" if "output.weight" in self.tensors else "token_embd.weight"]
        _, index, proj = name.split(".")
        return [f"blk.{index}.{p}.weight" for p in _PARTS[proj]]

    def native(self, gguf_name: str) -> QuantizedWeight:
        t = self.tensors[gguf_name]
        kind = t.tensor_type.name
        k, n = int(t.shape[0]), int(t.shape[1])
        if kind in ("Q4_0", "Q4_1"):
            qw: QuantizedWeight = q4_blocks_to_int4(t.data, kind, n, k)
        elif kind == "Q8_0":
            qw = q8_blocks_to_int8(t.data, n, k)
        else:
            raise ValueError(f"{gguf_name} is {kind}, not one of {NATIVE_TYPES}")
        part = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
        if self.arch == "llama" and part in self.heads:
            qw = _unpermute_rows(qw, self.heads[part])
        return qw

    def __call__(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearLayer:
        from hasten.quant.kernels import INT4_AUTO_GGUF, INT8_AUTO_GGUF, make_layer

        if name == "lm_head" and not self.quantize_lm_head:
            self.report[name] = "dense"
            return DenseLinear(weight, bias)
        names = self.gguf_names(name)
        kinds = {self.tensors[g].tensor_type.name for g in names}
        if kinds <= {"Q4_0", "Q4_1"} or kinds == {"Q8_0"}:
            qw = concat_rows([self.native(g) for g in names])
            self.report[name] = "+".join(sorted(kinds))
        elif kinds <= set(FLOAT_TYPES):
            self.report[name] = "dense"
            return DenseLinear(weight, bias)
        else:
            logger.warning("%s: GGUF types %s are not served natively; requantizing to int8", name, sorted(kinds))
            qw = quantize_int8(weight)
            self.report[name] = "int8-requant"
        if tuple(qw.shape) != tuple(weight.shape):
            raise ValueError(f"{name}: GGUF blocks give {qw.shape}, the model expects {tuple(weight.shape)}")
        qw.bias = bias
        return make_layer(qw, self.max_kernel_rows, self.int4_kernel, self.int8_kernel, INT4_AUTO_GGUF, self.q8_gemm,
                          INT8_AUTO_GGUF)


def gguf_source(folder: Path) -> Path:
    """The GGUF a converted folder came from (its hasten_source.json)."""
    src = folder / "hasten_source.json"
    if not src.exists():
        raise ValueError(f"quantization='gguf' needs a model converted from a .gguf file; {folder} has no hasten_source.json")
    return Path(json.loads(src.read_text())["gguf"])
