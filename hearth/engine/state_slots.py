"""The state cache's bookkeeping: which running request holds which state slot, and which cached prefix
has a state checkpoint in which checkpoint slot. No tensors.

A hybrid model (lfm2, qwen3_5) has layers that keep a fixed-size state per sequence rather than K/V
per token (a convolution's window, a delta rule's state; ModelConfig.state_shapes). The runner holds
those states for `num_slots` sequences (the tensors, hearth/engine/runner.py); this hands out the
slots. A request needs one to be admitted (the scheduler stops admitting when none is free), keeps
it while it runs, and gives it back when it finishes, is aborted or is preempted: a preempted request
recomputes its state from its tokens when it runs again (re-prefill from position 0, where its state
starts at zero whatever the slot held). A running state is never shared, and the slots come out of the same memory budget as the
KV blocks (hearth/engine/memory.py, split_budget).

Prefix caching on a hybrid model (StateCheckpoints): a prefix's K/V blocks alone do not let a request
start after them; the state layers' states at the end of the prefix are needed too. So at some block
boundaries a request's state is copied into a checkpoint slot (rows of the same state tensors, after
the running slots), entered under the content id of the cached block that ends the prefix (the KV
chain's exact name for it, kv_cache.py), and a request whose prefix lookup reaches such a block copies
the checkpoint into its own slot and starts after it (as llama.cpp's --ctx-checkpoints and vLLM's hybrid
prefix caching do). The boundaries (Scheduler._next_checkpoint; a prompt's chunk ends at each, so that
the state there exists):
  * the prompt's last full block, short of its last token: what the same prompt (n > 1 samples, a
    retry) and every longer one that starts with it (a conversation's next turn) can find;
  * the junction: where the request's cached K/V ended at admission, when that lies past its checkpoint
    (the point where it parts from an earlier request): every later request that shares that much finds
    it, so a system prompt shared by many costs one recomputation of its tail, not one each;
  * every `interval_blocks` blocks of its tokens, prompt or output: a bound on what any sharer recomputes.
The checkpoints are as many as the running slots (memory.py counts them in the budget), so that the
sequences that may run at once can each leave one; a checkpoint taken when all are used replaces the
least recently used (taken or restored) one. A checkpoint lives only with its block: evicting the
block drops it (BlockManager._evict), and a lookup reaches it only through every block of its prefix.
The copies are moves the runner makes before the next forward pass (`take_moves`, in order: the
saves of the step before, whose sources no pass has overwritten yet, then the restores of this one).
"""

from __future__ import annotations

from collections import OrderedDict

from hearth.engine.request import Request

CHECKPOINT_INTERVAL_BLOCKS = 64  # 1,024 tokens at the default block size


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


class StateCheckpoints:
    """Checkpoint slots first_slot .. first_slot + count - 1 of the state tensors, each holding the states
    at the end of one cached prefix, named by the content id of the block that ends it (kv_cache.py)."""

    def __init__(self, first_slot: int, count: int, interval_blocks: int = CHECKPOINT_INTERVAL_BLOCKS):
        if count < 1 or interval_blocks < 1:
            raise ValueError(f"need at least one checkpoint and an interval of a block, got {count}, {interval_blocks}")
        self.count, self.interval_blocks = count, interval_blocks
        self._free = list(range(first_slot + count - 1, first_slot - 1, -1))
        self._slots: OrderedDict[int, int] = OrderedDict()  # content id -> checkpoint slot, least recently used first
        self._moves: list[tuple[int, int]] = []  # (from slot, to slot), in the order they are to be made

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, content_id: int) -> bool:
        return content_id in self._slots

    def __iter__(self):
        """The content ids that have a checkpoint, least recently used first."""
        return iter(list(self._slots))

    def prefix_end(self, content_ids: list[int]) -> int:
        """How many leading blocks of a chain (their content ids, in order) end at its last checkpoint (0: none)."""
        return next((n for n in range(len(content_ids), 0, -1) if content_ids[n - 1] in self._slots), 0)

    def slot(self, content_id: int) -> int:
        return self._slots[content_id]

    def enter(self, content_id: int) -> int:
        """The prefix content_id's checkpoint slot, taken (from the least recently used one when none is
        free) where it has none; its states are the caller's to write (an import, or a save's move)."""
        if content_id not in self._slots:
            self._slots[content_id] = self._free.pop() if self._free else self._slots.popitem(last=False)[1]
        self._slots.move_to_end(content_id)
        return self._slots[content_id]

    def save(self, content_id: int, state_slot: int) -> None:
        """Checkpoint the state in state_slot as the prefix content_id's (kept if it has one already)."""
        if content_id in self._slots:
            self._slots.move_to_end(content_id)
        else:
            self._moves.append((state_slot, self.enter(content_id)))

    def restore(self, content_id: int, state_slot: int) -> None:
        """Copy the prefix content_id's checkpoint into state_slot (a request starting after it)."""
        self._slots.move_to_end(content_id)
        self._moves.append((self._slots[content_id], state_slot))

    def drop(self, content_id: int) -> None:
        """Forget the prefix's checkpoint, if it has one (its block was evicted)."""
        slot = self._slots.pop(content_id, None)
        if slot is not None:
            self._free.append(slot)

    def clear(self) -> None:
        for content_id in list(self._slots):
            self.drop(content_id)

    def take_moves(self) -> list[tuple[int, int]]:
        """The copies (from slot, to slot) asked for since the last call, for the runner to make in order."""
        moves, self._moves = self._moves, []
        return moves
