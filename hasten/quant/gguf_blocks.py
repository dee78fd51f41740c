"""Read GGUF blocks straight into our layouts (no float round trip): Q4_0 / Q4_1 / Q4_K here, the
5-, 6- and 8-bit types (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) in hasten/quant/gguf_kquants.py.

Block formats (ggml):
  Q4_0: 32 weights: fp16 d, 16 bytes of nibbles          -> w = (q - 8) * d
  Q4_1: 32 weights: fp16 d, fp16 m, 16 bytes of nibbles  -> w = q * d + m
  Q8_0: 32 weights: fp16 d, 32 int8                      -> w = q * d
  Q4_K: 256 weights: fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks of
        32, 128 bytes of nibbles                           -> w = q * (d * sc) - dmin * m
Nibble j of byte i (low first) holds element i + 16 * j of a Q4_0 / Q4_1 block; in Q4_K each 32
bytes hold two sub-blocks, the low nibbles the first and the high nibbles the second. Q4_0/Q4_1
become an `Int4Weight` with group 32 exactly (scale d, min m or -8 d); Q4_K too, with each
sub-block's scale d * sc and min -dmin * m (the codes exactly; the kernels hold scales and mins
as float16, a relative rounding of at most 2^-11 where Q4_0 / Q4_1's fp16 d and m are exact).
A projection whose parts mix the two families (Q4_K_M's fused qkv: q, k Q5_0, v Q8_0 or Q4_K) is
served as grouped int8 throughout: the int4 codes fit it exactly. `q8_blocks_to_int8` (Q8_0 re-scaled
per output row, q' = round(q * d_group / s_row), s_row = max |w| / 127: one requantization) remains
for `GGUFLinearFactory(q8_0="row")`, the per-channel int8 kernel's layout.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from hasten.model.gguf_convert import ROPE_PERMUTED, gguf_to_hf_config, unpermute_rope_rows
from hasten.model.linear import DenseLinear, LinearLayer
from hasten.quant.formats import (
    GroupedInt8Weight,
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
    pack_nibbles,
    quantize_int8,
)
from hasten.quant.gguf_kquants import CONVERTERS, GROUPED_TYPES, concat_grouped, f16, k_scales_mins

logger = logging.getLogger(__name__)

BLOCK = 32
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
NATIVE_TYPES = tuple(sorted((*INT4_TYPES, *GROUPED_TYPES)))
QK_K = 256  # weights per K-quant super-block
FLOAT_TYPES = ("F32", "F16", "BF16")


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
    d = f16(blocks[..., 0:2])
    if kind == "Q4_0":
        mins = -8.0 * d
        qs = blocks[..., 2:18]
    else:
        mins = f16(blocks[..., 2:4])
        qs = blocks[..., 4:20]
    codes = _nibble_codes(qs)
    return Int4Weight(pack_nibbles(codes), d.contiguous(), mins.contiguous(), BLOCK)


def q4k_blocks_to_int4(data: np.ndarray, n: int, k: int) -> Int4Weight:
    """GGUF Q4_K row data uint8 [N, K / 256 * 144] -> Int4Weight group 32 (ggml's dequantize_row_q4_K)."""
    nb = k // QK_K
    blocks = np.asarray(data, dtype=np.uint8).reshape(n, nb, 144)
    d = f16(blocks[..., 0:2])[..., None]  # [N, nb, 1]
    dmin = f16(blocks[..., 2:4])[..., None]
    sc, m = k_scales_mins(blocks[..., 4:16])  # 6-bit scales and mins of the 8 sub-blocks
    q = torch.from_numpy(np.ascontiguousarray(blocks[..., 16:144])).reshape(n, nb, 4, 32)
    codes = torch.cat((q & 0x0F, q >> 4), dim=-1).reshape(n, k)  # per 64 weights: 32 low nibbles, 32 high
    scales = (d * sc.float()).reshape(n, nb * 8)
    mins = (-(dmin * m.float())).reshape(n, nb * 8)
    return Int4Weight(pack_nibbles(codes), scales.contiguous(), mins.contiguous(), BLOCK)


def q8_blocks_to_int8(data: np.ndarray, n: int, k: int) -> Int8Weight:
    """GGUF Q8_0 row data -> per-channel Int8Weight (integer rescale per row, see module doc)."""
    nb = k // BLOCK
    blocks = np.asarray(data, dtype=np.uint8).reshape(n, nb, 34)
    d = f16(blocks[..., 0:2])  # [N, nb]
    q = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:34]).view(np.int8)).float()  # [N, nb, 32]
    row_max = (q.abs().amax(-1) * d.abs()).amax(-1)  # max |w| per row
    s_row = (row_max / 127.0).clamp(min=1e-10)
    ratio = (d / s_row[:, None])[..., None]  # [N, nb, 1]
    q_new = torch.round(q * ratio).clamp_(-127, 127).to(torch.int8).reshape(n, k)
    return Int8Weight(q_new.contiguous(), s_row.contiguous())


def _unpermute_rows(qw: QuantizedWeight, heads: int) -> QuantizedWeight:
    """llama.cpp permutes q/k rows for its RoPE; rows are whole, so permute codes and scales alike."""
    def perm(t: torch.Tensor) -> torch.Tensor:
        return unpermute_rope_rows(t, heads).contiguous()

    if isinstance(qw, Int4Weight):
        return Int4Weight(perm(qw.qweight), perm(qw.scales), perm(qw.mins), qw.group_size)
    if isinstance(qw, GroupedInt8Weight):
        return GroupedInt8Weight(perm(qw.qweight), perm(qw.scales), None if qw.mins is None else perm(qw.mins),
                                 qw.group_size)
    return Int8Weight(perm(qw.qweight), perm(qw.scales))


def concat_rows(parts: list[QuantizedWeight | GroupedInt8Weight]) -> QuantizedWeight | GroupedInt8Weight:
    first = parts[0]
    if len(parts) == 1:
        return first
    kinds = {(type(p), getattr(p, "group_size", 0)) for p in parts}
    if len(kinds) > 1 or isinstance(first, GroupedInt8Weight):
        return concat_grouped(parts)
    if isinstance(first, Int4Weight):
        return Int4Weight(
            torch.cat([p.qweight for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat([p.mins for p in parts]),
            first.group_size,
        )
    return Int8Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]))


_FUSED = {"qkv_proj": "attn_qkv", "gate_up_proj": "ffn_up"}  # Phi-3 keeps these fused in the file
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
        int8_kernel: str = "auto", q8_gemm: bool = True, q8_0: str = "grouped",
        layer_maker: Callable[[QuantizedWeight | GroupedInt8Weight], LinearLayer] | None = None,
        wide: dict | None = None,
    ):
        """q8_0: "grouped" serves Q8_0 blocks as they are (a scale per 32 weights); "row" re-scales
        them per output row for the per-channel int8 kernel (one rounding, a little less memory).
        wide (make_layer's bf16_gemm* and u8_gemm* keywords, QuantOptions.wide_options): the wide-call
        paths (see make_layer); none given: neither."""
        from gguf import GGUFReader

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
        self.wide = dict(wide or {})
        if q8_0 not in ("grouped", "row"):
            raise ValueError(f"q8_0 must be 'grouped' or 'row', got {q8_0!r}")
        self.q8_0 = q8_0
        self.quantize_lm_head = quantize_lm_head
        self.report: dict[str, str] = {}  # layer name -> how it was served
        self.layer_maker = layer_maker  # see QuantizingFactory

    def gguf_names(self, name: str) -> list[tuple[str, int | None]]:
        """The GGUF tensors (and expert index, for stacked experts) one projection's rows come from."""
        if name == "lm_head":
            return [("output.weight" if "output.weight" in self.tensors else "token_embd.weight", None)]
        parts = name.split(".")
        if len(parts) == 5 and parts[2] == "experts":  # layers.{i}.experts.{e}.{gate_up_proj|down_proj}
            exps = ("ffn_gate_exps", "ffn_up_exps") if parts[4] == "gate_up_proj" else ("ffn_down_exps",)
            return [(f"blk.{parts[1]}.{p}.weight", int(parts[3])) for p in exps]
        _, index, proj = parts
        if self.arch == "phi3" and proj in _FUSED:  # Phi-3's attn_qkv, and ffn_up holding gate and up
            return [(f"blk.{index}.{_FUSED[proj]}.weight", None)]
        return [(f"blk.{index}.{p}.weight", None) for p in _PARTS[proj]]

    def native(self, gguf_name: str, row_q8: bool = False, expert: int | None = None
               ) -> QuantizedWeight | GroupedInt8Weight:
        t = self.tensors[gguf_name]
        kind = t.tensor_type.name
        k, n = int(t.shape[0]), int(t.shape[1])
        data = t.data
        if expert is not None:  # stacked experts [E, N, row bytes]: one expert's rows
            data = np.asarray(data).reshape(int(t.shape[2]), n, -1)[expert]
        if kind in ("Q4_0", "Q4_1"):
            qw: QuantizedWeight | GroupedInt8Weight = q4_blocks_to_int4(data, kind, n, k)
        elif kind == "Q4_K":
            qw = q4k_blocks_to_int4(data, n, k)
        elif kind == "Q8_0" and row_q8:
            qw = q8_blocks_to_int8(data, n, k)
        elif kind in CONVERTERS:
            qw = CONVERTERS[kind](data, n, k)
        else:
            raise ValueError(f"{gguf_name} is {kind}, not one of {NATIVE_TYPES}")
        part = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
        if self.arch in ROPE_PERMUTED and part in self.heads:
            qw = _unpermute_rows(qw, self.heads[part])
        return qw

    def __call__(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearLayer:
        from hasten.quant.kernels import INT4_AUTO_GGUF, INT8_AUTO_GGUF, make_layer

        if name == "lm_head" and not self.quantize_lm_head:
            self.report[name] = "dense"
            return DenseLinear(weight, bias)
        names = self.gguf_names(name)
        found = all(g in self.tensors for g, _ in names)
        kinds = {self.tensors[g].tensor_type.name for g, _ in names} if found else {"(no such tensor)"}
        if kinds <= set(NATIVE_TYPES):
            row_q8 = kinds == {"Q8_0"} and self.q8_0 == "row"
            qw = concat_rows([self.native(g, row_q8, e) for g, e in names])
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
        if self.layer_maker is not None:
            return self.layer_maker(qw)
        return make_layer(qw, self.max_kernel_rows, self.int4_kernel, self.int8_kernel, INT4_AUTO_GGUF, self.q8_gemm,
                          INT8_AUTO_GGUF, **self.wide)


def gguf_source(folder: Path) -> Path:
    """The GGUF a converted folder came from (its hasten_source.json)."""
    src = folder / "hasten_source.json"
    if not src.exists():
        raise ValueError(f"quantization='gguf' needs a model converted from a .gguf file; {folder} has no hasten_source.json")
    return Path(json.loads(src.read_text())["gguf"])
