"""A decode step's inputs kept on the device between steps, changed by small diffs.

A decode step of b sequences needs, per row: its token, its context length (new token included),
its block table, a hybrid model's state slot (hearth/triton_kernels/state_ops.py), and (when sampling runs in the step's CUDA graph) its sampling parameters. From
one step to the next almost nothing of that changes but the tokens: every context grows by one,
and a block table gains an entry once every block_size steps. So the inputs live in persistent
device buffers (the CUDA graphs of graphs.py read them in place), and a step sends only what its
rows differ by from the prediction "every live row decodes again":

  1. on the device, seq_lens += live (live: 1 for a row that decoded last time, 0 for padding),
  2. one host-to-device copy of the patch (flat indices and values of the int32 entries that
     differ from that prediction: every token, the new block ids, the rows whose sequence changed,
     padding), scattered into the buffer by one index_put_,
  3. the sampling parameters, rows whose values changed only (a second small copy, when any).

A host mirror of the buffers says what the device holds once the queued work has run; the diff
is against it, so any history (eager steps in between, preemptions, rows changing places) ends in
the same device state as writing the step from scratch (`rewrite`). The positions and slots are
not sent: a decode's position is its context length - 1 (an M-RoPE model's, plus the row's rope delta,
which changes only with the row's sequence) and its slot follows from its block table (`positions_and_slots`,
run inside the graph). Rows past the batch (up to the graph's bucket) are
padding: live 0, context 0 (attention gives zeros; the state kernels read a zero state and write
nothing), slot -1 (the K/V write is skipped), token 0, state slot 0.

Patches go through two pinned host buffers used in turn, each released by a CUDA event when its
copy has run: the host may lay out the next step's patch while the GPU still copies this one's.
"""

from __future__ import annotations

import numpy as np
import torch

from hearth.backend.base import StepInputs

# fields of the int32 buffer, each [max_batch] but the block tables [max_batch, max_blocks]; rope_delta: an M-RoPE
# model's text token's position less its place in the sequence (the shift of the images before it; else 0)
_ROW_FIELDS = ("input_ids", "seq_lens", "live", "state_slots", "rope_delta")


class DecodeInputs:
    """The persistent int32 buffer (tokens, context lengths, live flags, state slots, block tables) and float64
    sampling parameters [num_params, max_batch] of decode steps, and their diff updates."""

    def __init__(self, max_batch: int, max_blocks: int, block_size: int, device: torch.device):
        self.max_batch, self.max_blocks, self.block_size, self.device = max_batch, max_blocks, block_size, device
        n = max_batch
        self._offsets = {name: i * n for i, name in enumerate(_ROW_FIELDS)}
        self._tables_at = len(_ROW_FIELDS) * n
        size = self._tables_at + n * max_blocks
        self.state = torch.zeros(size, dtype=torch.int32, device=device)
        self._mirror = np.zeros(size, dtype=np.int32)  # what `state` holds once the queued work has run
        self._row_cols = np.zeros(n, dtype=np.int64)  # per row: its table's columns that may hold a nonzero id
        # the rows' sampling parameters [num_params, max_batch] float64, made by the first update that has them
        self.params: torch.Tensor | None = None
        self._param_defaults = self._param_mirror = None
        self._pinned = device.type == "cuda"
        # two staging buffers for int32 patches (indices, then values), two for parameter columns
        self._staging = [torch.empty(2 * size, dtype=torch.int32, pin_memory=self._pinned) for _ in range(2)]
        self._param_staging: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.patched = 0  # int32 entries sent by the last update (tests, benchmarks)

    # ---- views ------------------------------------------------------------------------

    def field(self, name: str, size: int) -> torch.Tensor:
        """The device buffer's first `size` rows of a row field: input_ids, seq_lens, live, state_slots or
        rope_delta."""
        start = self._offsets[name]
        return self.state[start : start + size]

    def block_tables(self, size: int) -> torch.Tensor:  # int32 [size, max_blocks]
        return self.state[self._tables_at :].view(self.max_batch, self.max_blocks)[:size]

    def positions_and_slots(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's position (its context length - 1, plus its rope delta; 0 on padding) and cache slot (-1
        on padding), int32 [size] each, computed on the device from the buffer (capturable: no host reads)."""
        seq_lens, live = self.field("seq_lens", size), self.field("live", size)
        index = (seq_lens - 1).clamp_min(0)  # the new token's place in its sequence
        blocks = self.block_tables(size).gather(1, (index // self.block_size).long()[:, None]).squeeze(1)
        slots = torch.where(live > 0, blocks * self.block_size + index % self.block_size, -1)
        return index + self.field("rope_delta", size), slots

    # ---- updates ----------------------------------------------------------------------

    def fits(self, step: StepInputs) -> bool:
        """A decode step these buffers hold: at most max_batch rows, tables at most max_blocks wide,
        every position its context length - 1 (no token trees); M-RoPE's [3, b]: a text token's, its three
        positions alike (the rope delta kept per row)."""
        positions = step.positions
        return (step.decode_only and step.num_seqs <= self.max_batch and step.block_tables.shape[1] <= self.max_blocks
                and (np.array_equal(positions, step.seq_lens - 1) if positions.ndim == 1 else
                     bool((positions == positions[:1]).all())))

    def update(self, step: StepInputs, size: int, params: np.ndarray | None = None,
               param_defaults: tuple[float, ...] = ()) -> None:
        """Make the buffers' first `size` rows the step's (its b rows, then padding), by diffs.
        params: float64 [num_params, b] the rows' sampling parameters (None: leave them), padding
        rows taking param_defaults (one value per parameter)."""
        n, mirror = self.max_batch, self._mirror
        seq, live = self._offsets["seq_lens"], self._offsets["live"]
        mirror[seq : seq + n] += mirror[live : live + n]  # what step 1 does on the device
        indices, values = [], []
        for name, target in zip(_ROW_FIELDS, self._row_targets(step, size)):
            start = self._offsets[name]
            changed = np.flatnonzero(target != mirror[start : start + size])
            indices.append(start + changed)
            values.append(target[changed])
        b, width = step.num_seqs, step.block_tables.shape[1]
        cols = max(width, int(self._row_cols[:size].max()))  # also the columns an earlier, wider table left
        tables = np.zeros((size, cols), dtype=np.int32)
        tables[:b, :width] = step.block_tables
        rows, columns = np.nonzero(tables != self._mirror_tables[:size, :cols])
        indices.append(self._tables_at + rows * self.max_blocks + columns)
        values.append(tables[rows, columns])
        self._row_cols[:b], self._row_cols[b:size] = width, 0
        turn = self._next_turn()
        self._patch(np.concatenate(indices).astype(np.int32), np.concatenate(values), turn)
        if params is not None:
            self._update_params(params, param_defaults, size, turn)
        self._write_ids_on_device(step)
        if self.device.type == "cuda":  # the staging buffers of this turn are free again once this has run
            self._events[turn] = torch.cuda.Event()
            self._events[turn].record()

    def rewrite(self, step: StepInputs, size: int, params: np.ndarray | None = None,
                param_defaults: tuple[float, ...] = ()) -> None:
        """The same state written from scratch: the buffers zeroed, then every nonzero entry of the
        rows' fields and tables and every parameter sent (the reference the diffs are tested against)."""
        self._mirror[:] = 0
        self._row_cols[:] = 0
        self.state.zero_()
        self.params = None  # (made again: every column sent)
        self.update(step, size, params, param_defaults)

    def _row_targets(self, step: StepInputs, size: int) -> tuple[np.ndarray, ...]:
        """What input_ids, seq_lens, live, state_slots and rope_delta must hold in the first `size` rows, int32
        each."""
        b = step.num_seqs
        ids, seq_lens, live, state_slots, rope_delta = np.zeros((5, size), dtype=np.int32)
        if isinstance(step.input_ids, torch.Tensor):  # copied device to device: no patch for them
            start = self._offsets["input_ids"]
            ids[:b] = self._mirror[start : start + b]
        else:
            ids[:b] = step.input_ids
        seq_lens[:b] = step.seq_lens
        live[:b] = 1
        if step.state_slots is not None:
            state_slots[:b] = step.state_slots
        if step.positions.ndim == 2:  # M-RoPE
            rope_delta[:b] = step.positions[0] - (step.seq_lens - 1)
        return ids, seq_lens, live, state_slots, rope_delta

    @property
    def _mirror_tables(self) -> np.ndarray:  # int32 [max_batch, max_blocks], a view
        return self._mirror[self._tables_at :].reshape(self.max_batch, self.max_blocks)

    def _make_params(self, defaults: tuple[float, ...]) -> None:
        """The parameter buffer, every row at `defaults` (the mirror NaN: every column differs, is sent)."""
        fields, n = len(defaults), self.max_batch
        self._param_defaults = np.asarray(defaults, dtype=np.float64)
        self.params = torch.empty((fields, n), dtype=torch.float64, device=self.device)
        self._param_mirror = np.full((fields, n), np.nan)
        self._param_staging = [torch.empty((1 + fields) * n, dtype=torch.float64, pin_memory=self._pinned)
                               for _ in range(2)]

    def _next_turn(self) -> int:
        """The staging buffers to use now, once the copies that last read them have run."""
        self._turn ^= 1
        event = self._events[self._turn]
        if event is not None:
            event.synchronize()
        return self._turn

    def _patch(self, indices: np.ndarray, values: np.ndarray, turn: int) -> None:
        """seq_lens += live on the device, then the patch copied over and scattered in."""
        self._mirror[indices] = values
        self.patched = k = len(indices)
        seq, live, n = self._offsets["seq_lens"], self._offsets["live"], self.max_batch
        self.state[seq : seq + n] += self.state[live : live + n]
        if not k:
            return
        staging = self._staging[turn]
        host = staging.numpy()
        host[:k], host[k : 2 * k] = indices, values
        patch = staging[: 2 * k].to(self.device, non_blocking=True)
        self.state.index_put_((patch[:k],), patch[k:])

    def _update_params(self, params: np.ndarray, defaults: tuple[float, ...], size: int, turn: int) -> None:
        """The rows whose sampling parameters changed, written as whole columns."""
        if self.params is None or len(defaults) != len(self.params):
            self._make_params(defaults)
        target = np.repeat(self._param_defaults[:, None], size, 1)
        target[:, : params.shape[1]] = params
        rows = np.flatnonzero((target != self._param_mirror[:, :size]).any(axis=0))
        if not len(rows):
            return
        self._param_mirror[:, rows] = target[:, rows]
        k, fields = len(rows), len(target)
        staging = self._param_staging[turn]
        host = staging.numpy()
        host[:k], host[k : k * (1 + fields)] = rows, target[:, rows].reshape(-1)
        patch = staging[: k * (1 + fields)].to(self.device, non_blocking=True)
        self.params[:, patch[:k].long()] = patch[k:].view(fields, k)

    def _write_ids_on_device(self, step: StepInputs) -> None:
        """Tokens a pass before drew and the host has not read: copied device to device."""
        if isinstance(step.input_ids, torch.Tensor):
            self.field("input_ids", step.num_seqs).copy_(step.input_ids)
            self._mirror[self._offsets["input_ids"] : self._offsets["input_ids"] + step.num_seqs] = -1  # unknown
