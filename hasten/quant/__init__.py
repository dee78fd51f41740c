"""Weight-only INT8 / INT4 quantization: layouts, CPU kernels, AWQ, GGUF blocks, quality gate.

The engine calls `linear_factory_for(config, model_folder)` when `EngineConfig.quantization`
is set (`LLM(quantization="int8" | "int4" | "gguf")`). See docs/quantization.md.
"""

from __future__ import annotations

from hasten.quant.factory import QuantizingFactory, QuantOptions, linear_factory_for, quantized_path
from hasten.quant.formats import Int4Weight, Int8Weight, quantize_int4, quantize_int8
from hasten.quant.kernels import Int4Linear, Int8Linear, make_layer

__all__ = [
    "Int4Linear",
    "Int4Weight",
    "Int8Linear",
    "Int8Weight",
    "QuantOptions",
    "QuantizingFactory",
    "linear_factory_for",
    "make_layer",
    "quantize_int4",
    "quantize_int8",
    "quantized_path",
]
