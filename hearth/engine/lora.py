"""The LoRA adapters an engine serves: their names, the number of each load, and the model's slot
each one sits in. Bookkeeping only: the matrices are the model's (hearth/model/lora.py's LoraBank,
which the runner activates for each step's rows); the files are read by hearth/loading/lora.py.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hearth.errors import ModelLoadError, RequestError
from hearth.loading.lora import read_lora_adapter
from hearth.lora_request import LoRARequest
from hearth.model.lora import LoraBank


@dataclass(frozen=True)
class LoadedAdapter:
    name: str
    path: str
    lora_id: int  # this load's number (Request.lora_id); never reused
    slot: int  # its slot in the model's LoraBank


class LoraAdapters:
    def __init__(self, bank: LoraBank):
        self.bank = bank
        self.by_name: dict[str, LoadedAdapter] = {}
        self.slots: dict[int, int] = {}  # lora_id -> slot, for the runner
        self._ids = itertools.count(1)

    def add(self, request: LoRARequest) -> LoadedAdapter:
        """Load the adapter into a free slot (ModelLoadError for a bad adapter, RequestError for a name
        already in use by another path or for no free slot); an adapter already loaded from the same
        path is returned as it is."""
        loaded = self.by_name.get(request.lora_name)
        if loaded is not None:
            if request.lora_path and request.lora_path != loaded.path:
                raise RequestError(f"a LoRA adapter named {request.lora_name!r} is already loaded (from "
                                   f"{loaded.path}); unload it first")
            return loaded
        if not request.lora_name:
            raise RequestError("a LoRA adapter needs a name")
        adapter = read_lora_adapter(request.lora_name, request.lora_path)
        self.bank.check(adapter)  # a bad adapter is told so before a full engine is
        free = sorted(set(range(self.bank.max_loras)) - set(self.slots.values()))
        if not free:
            raise RequestError(f"{self.bank.max_loras} LoRA adapters are loaded, this engine's max_loras "
                               "(--max-loras): unload one first")
        self.bank.load(free[0], adapter)
        loaded = LoadedAdapter(request.lora_name, str(request.lora_path), next(self._ids), free[0])
        self.by_name[loaded.name] = loaded
        self.slots[loaded.lora_id] = loaded.slot
        return loaded

    def remove(self, name: str, requests_using: int) -> None:
        """Unload the adapter; RequestError when none is loaded by that name or requests still run with it."""
        loaded = self.by_name.get(name)
        if loaded is None:
            raise RequestError(f"no LoRA adapter named {name!r} is loaded")
        if requests_using:
            raise RequestError(f"LoRA adapter {name!r} is in use by {requests_using} unfinished requests; unload "
                               "it once they are done")
        del self.by_name[name], self.slots[loaded.lora_id]
        self.bank.clear(loaded.slot)

    def lora_id(self, request: LoRARequest | None) -> int:
        """The load number a request runs with (0: none); the adapter is loaded first if it is not."""
        if request is None:
            return 0
        if request.lora_name not in self.by_name and not request.lora_path:
            raise RequestError(f"no LoRA adapter named {request.lora_name!r} is loaded")
        try:
            return self.add(request).lora_id
        except ModelLoadError as e:
            raise RequestError(str(e)) from None
