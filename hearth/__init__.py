"""hearth: an LLM inference engine. The public face: LLM, SamplingParams and what generate returns."""

from hearth.llm import LLM
from hearth.outputs import CompletionOutput, RequestOutput
from hearth.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams, WatermarkParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "WatermarkParams", "BeamSearchParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
