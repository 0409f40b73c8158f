"""Block quantization: GGUF block formats, dequantization, and the QuantTensor weight."""

from hearth.quant.formats import SUPPORTED_QTYPES, dequantize, quantize
from hearth.quant.tensor import QuantTensor

__all__ = ["QuantTensor", "SUPPORTED_QTYPES", "dequantize", "quantize"]
