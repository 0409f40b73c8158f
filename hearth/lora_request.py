"""LoRARequest: which LoRA adapter a request runs with, as vLLM names it (vllm.lora.request.LoRARequest)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: the adapter's name (what a server's clients give as `model`); lora_int_id: vLLM's
    own id for it (kept for vLLM's signature: hearth numbers each load itself, so that a reloaded
    adapter never meets the prefix cache of the one before it); lora_path: the PEFT adapter folder."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
