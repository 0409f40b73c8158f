"""hearth: an LLM inference engine. The public face: LLM, SamplingParams and what generate returns."""

import os

# torch's CPU allocator puts each tensor of 2 MB or more on 2 MB pages (transparent huge pages, asked for by
# madvise) where this is set before its first allocation: the weights and K/V a decode step streams then take a
# 512th of the page walks, and the prefetchers no longer stop at every 4 KB (a 4-layer TinyLlama Q4_K_M's greedy
# kernel 4.52 -> 4.28 ms, medians of 6 alternated processes, EPYC-512). A value already set is kept; 0 turns it off.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

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
