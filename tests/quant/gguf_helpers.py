"""Random GGUF blocks of every type hasten reads, and a tiny Llama whose projections are such blocks:
a GGUF file (written with the gguf package) next to an HF folder holding the same weights as
gguf's own dequantizer gives them, for model-level tests of quantization="gguf"."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

# kind -> (bytes per block, weights per block, byte offsets of the fp16 fields, their magnitude)
BLOCKS = {  # magnitudes: weights up to about 0.06 in every type, as in a real model of this width
    "Q8_0": (34, 32, {0: 5e-4}),
    "Q5_0": (22, 32, {0: 4e-3}),
    "Q5_1": (24, 32, {0: 2e-3, 2: -3e-2}),
    "Q4_0": (18, 32, {0: 8e-3}),
    "Q4_1": (20, 32, {0: 4e-3, 2: -3e-2}),
    "Q4_K": (144, 256, {0: 6e-5, 2: 5e-4}),
    "Q5_K": (176, 256, {0: 3e-5, 2: 5e-4}),
    "Q6_K": (210, 256, {208: 8e-5}),
}


def random_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw rows uint8 [n, k / weights per block * bytes]: random codes, scale bytes and fp16 fields
    (positive, up to twice `magnitude`; negative magnitudes give negative values, as Q4_1's mins)."""
    size, per, halves = BLOCKS[kind]
    blocks = rng.integers(0, 256, size=(n, k // per, size), dtype=np.uint8)
    for off, mag in halves.items():
        v = ((rng.random((n, k // per)) + 0.05) * mag).astype(np.float16)
        blocks[..., off:off + 2] = v[..., None].view(np.uint8).reshape(n, k // per, 2)
    if kind == "Q6_K":  # int8 sub-block scales of a modest size
        blocks[..., 192:208] = rng.integers(-24, 25, size=(n, k // per, 16)).astype(np.int8).view(np.uint8)
    return blocks.reshape(n, -1)


def dequantized(kind: str, data: np.ndarray, n: int, k: int) -> np.ndarray:
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    return np.asarray(dequantize(data, T[kind]), dtype=np.float32).reshape(n, k)


_GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
               "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def write_block_model(folder: Path, kinds: dict[str, str], seed: int = 0) -> Path:
    """Give the tiny Llama in `folder` (hidden 256: whole K-quant super-blocks) random GGUF blocks for
    every projection and lm_head, `kinds` naming each one's type by HF suffix (q_proj, ..., lm_head;
    "*" for the rest). Writes model.gguf (its q / k rows in llama.cpp's RoPE order, as
    convert_hf_to_gguf writes them), the dequantized weights into the folder's safetensors, and
    hasten_source.json, so that quantization="gguf" serves the blocks."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter
    from safetensors.torch import load_file, save_file

    from hasten.model.gguf_convert import unpermute_rope_rows

    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(folder / "model.gguf"), "llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    writer.add_vocab_size(cfg["vocab_size"])
    for name in list(state):
        parts = name.split(".")
        suffix = "lm_head" if name == "lm_head.weight" else parts[-2]
        if suffix not in _GGUF_NAMES and suffix != "lm_head":
            continue
        kind = kinds.get(suffix, kinds["*"])
        n, k = state[name].shape
        data = random_blocks(kind, n, k, rng)
        w = dequantized(kind, data, n, k)
        if suffix in ("q_proj", "k_proj"):  # the file holds llama.cpp's row order
            w = unpermute_rope_rows(w, cfg["num_attention_heads" if suffix == "q_proj" else "num_key_value_heads"])
        state[name] = torch.from_numpy(np.ascontiguousarray(w))
        gguf_name = "output.weight" if suffix == "lm_head" else f"blk.{parts[2]}.{_GGUF_NAMES[suffix]}.weight"
        writer.add_tensor(gguf_name, data, raw_dtype=T[kind])
    embed = state["model.embed_tokens.weight"].numpy()
    writer.add_tensor("token_embd.weight", np.ascontiguousarray(embed, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file(state, str(folder / "model.safetensors"))
    (folder / "hasten_source.json").write_text(json.dumps({"gguf": str((folder / "model.gguf").resolve())}))
    return folder


def requantize_gguf(src: Path, dst: Path, kind: str) -> Path:
    """A copy of the GGUF `src` whose weight matrices (projections, stacked experts and the output
    head; not norms, routers or the embedding) are `kind` blocks made by the gguf package's own
    quantizer (Q8_0, Q5_0, Q5_1, Q4_0, Q4_1), every metadata field kept."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize, quantize

    reader = GGUFReader(str(src))
    writer = GGUFWriter(str(dst), str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if arr.ndim >= 2 and "ffn_gate_inp" not in t.name and t.name != "token_embd.weight":
            writer.add_tensor(t.name, quantize(arr, T[kind]), raw_dtype=T[kind])
        else:
            writer.add_tensor(t.name, np.ascontiguousarray(arr))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
