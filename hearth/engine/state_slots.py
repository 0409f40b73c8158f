"""The state cache's bookkeeping: which running request holds which state slot. No tensors.

A hybrid model (lfm2, qwen3_5) has layers that keep a fixed-size state per sequence rather than K/V
per token (a convolution's window, a delta rule's state; ModelConfig.state_shapes). The runner holds
those states for `num_slots` sequences (the tensors, hearth/engine/runner.py); this hands out the
slots. A request needs one to be admitted (the scheduler stops admitting when none is free), keeps
it while it runs, and gives it back when it finishes, is aborted or is preempted: a preempted request
recomputes its state from its tokens when it runs again (re-prefill from position 0, where its state
starts at zero whatever the slot held). So a state is never shared and never copied, and the slots
come out of the same memory budget as the KV blocks (hearth/engine/memory.py, state_slot_count).
"""

from __future__ import annotations

from hearth.engine.request import Request


class StateSlots:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"need at least one state slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: the lowest slot first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, request: Request) -> bool:
        """Give the request a slot (it keeps the one it holds); False when none is free."""
        if request.state_slot >= 0:
            return True
        if not self._free:
            return False
        request.state_slot = self._free.pop()
        return True

    def free(self, request: Request) -> None:
        """Take back the request's slot, if it holds one."""
        if request.state_slot >= 0:
            self._free.append(request.state_slot)
            request.state_slot = -1
