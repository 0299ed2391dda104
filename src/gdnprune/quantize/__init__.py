"""Quantized outputs in the formats engines serve: ``compressed-tensors`` checkpoints (FP8 block-scaled,
FP8 per-channel with dynamic activations, 4-bit integer weights with GPTQ) of every model gdnprune writes."""

from .api import QuantizedWidthWarning, compressed_scheme, quantize_checkpoint, quantize_model
from .gptq import Hessians, gptq, group_scales
from .schemes import SCHEMES, QuantizeError, Scheme, scheme_named, select_modules

__all__ = [
    "SCHEMES",
    "Scheme",
    "QuantizeError",
    "QuantizedWidthWarning",
    "quantize_checkpoint",
    "quantize_model",
    "compressed_scheme",
    "scheme_named",
    "select_modules",
    "gptq",
    "group_scales",
    "Hessians",
]
