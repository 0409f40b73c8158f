"""hearth: an LLM inference engine. The public face: LLM, SamplingParams and what generate returns."""

from hearth.lora_request import LoRARequest
from hearth.outputs import CompletionOutput, RequestOutput
from hearth.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams, WatermarkParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "WatermarkParams", "BeamSearchParams", "RequestOutput", "CompletionOutput",
           "LoRARequest"]


def __getattr__(name: str):
    # LLM imports torch: only when used, so that `hearth --help` and `--version` start at once.
    if name == "LLM":
        from hearth.llm import LLM

        return LLM
    if name == "__version__":  # the installed package's (pyproject.toml)
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("hearth")
        except PackageNotFoundError:  # a source tree that was never installed
            return "unknown"
    raise AttributeError(f"module 'hearth' has no attribute {name!r}")
