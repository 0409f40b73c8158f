"""The decode step's persistent device inputs (hearth/backend/decode_inputs.py): after every step of a
randomized run (arrivals, finishes, preemptions, rows changing places, block appends, batch-size
bucket changes, tokens left on the device), the buffers updated by diffs hold what a rebuild from
scratch holds, and the positions and slots computed from them are those of the runner's own layout
(ModelRunner.prepare, the eager path's inputs). The sequences are a hybrid model's: each holds a
state slot (hearth/triton_kernels/state_ops.py reads the buffer's), given back when it leaves."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import torch

from hearth.backend.decode_inputs import DecodeInputs
from hearth.backend.graphs import bucket_sizes
from hearth.engine.runner import BatchEntry, ModelRunner

BLOCK, MAX_BATCH, MAX_BLOCKS = 4, 12, 16
DEFAULTS = (1.0, 1.0, 50.0, 1.0, 0.0)


class Sequences:
    """Running sequences as the scheduler keeps them: context length, block table, sampling row."""

    def __init__(self, rng: random.Random):
        self.rng, self.running, self.free, self.state_slots = rng, [], list(range(1, 400)), list(range(MAX_BATCH))
        rng.shuffle(self.free)
        rng.shuffle(self.state_slots)

    def arrive(self) -> None:
        context = self.rng.randint(1, BLOCK * (MAX_BLOCKS - 3))
        table = [self.free.pop() for _ in range(-(-context // BLOCK))]
        params = (self.rng.choice([0.5, 1.0, 1.3]), float(self.rng.random() < 0.3), self.rng.choice([50, 5]),
                  self.rng.choice([1.0, 0.9]), self.rng.choice([0.0, 0.1]))
        self.running.append({"computed": context - 1, "table": table, "params": params,
                             "state_slot": self.state_slots.pop()})

    def leave(self) -> None:  # a finish or a preemption: its blocks go back
        seq = self.running.pop(self.rng.randrange(len(self.running)))
        self.free.extend(seq["table"])
        self.state_slots.insert(0, seq["state_slot"])  # (taken again last: a row's slot changes)

    def decode(self) -> bool:
        """Every row's token was computed: one more, a new block at a boundary. Whether a row began again."""
        again = False
        for seq in self.running:
            seq["computed"] += 1
            if seq["computed"] + 1 > len(seq["table"]) * BLOCK:
                seq["table"].append(self.free.pop())
            if seq["computed"] + 1 >= BLOCK * MAX_BLOCKS:  # (full: starts over, a new sequence in its row)
                seq["computed"], again = 0, True
        return again

    def step(self):
        config = SimpleNamespace(is_hybrid=True, mrope_section=None, bidirectional_images=False,
                                 bidirectional_images_sliding_only=False)
        runner = SimpleNamespace(block_size=BLOCK, model=SimpleNamespace(config=config))
        entries = [BatchEntry([self.rng.randrange(1000)], s["computed"], s["table"], state_slot=s["state_slot"])
                   for s in self.running]
        params = np.array([s["params"] for s in self.running], dtype=np.float64).T
        return ModelRunner.prepare(runner, entries), params


def check_against_rebuild(inputs: DecodeInputs, step, params: np.ndarray, size: int) -> None:
    fresh = DecodeInputs(MAX_BATCH, MAX_BLOCKS, BLOCK, torch.device("cpu"))
    fresh.rewrite(step, size, params, DEFAULTS)
    for name in ("input_ids", "seq_lens", "live", "state_slots"):
        assert torch.equal(inputs.field(name, size), fresh.field(name, size)), name
    assert torch.equal(inputs.block_tables(size), fresh.block_tables(size))
    assert torch.equal(inputs.params[:, :size], fresh.params[:, :size])
    b = step.num_seqs
    positions, slots = inputs.positions_and_slots(size)
    assert positions[:b].tolist() == step.positions.tolist() and slots[:b].tolist() == step.slot_mapping.tolist()
    assert slots[b:].tolist() == [-1] * (size - b) and inputs.field("seq_lens", size)[b:].tolist() == [0] * (size - b)
    assert inputs.field("state_slots", size).tolist() == step.state_slots.tolist() + [0] * (size - b)
    assert inputs.params[:, :b].numpy().tolist() == params.tolist()
    assert inputs.params[:, b:size].T.tolist() == [list(DEFAULTS)] * (size - b)


def test_diffs_hold_what_a_rebuild_holds_every_step_of_a_randomized_run():
    rng = random.Random(0)
    seqs = Sequences(rng)
    inputs = DecodeInputs(MAX_BATCH, MAX_BLOCKS, BLOCK, torch.device("cpu"))
    buckets, steady_patches, sizes, again = bucket_sizes(MAX_BATCH), [], set(), False
    for n in range(300):
        event = rng.random()
        if (event < 0.15 or not seqs.running) and len(seqs.running) < MAX_BATCH:
            for _ in range(rng.randint(1, min(4, MAX_BATCH - len(seqs.running)))):
                seqs.arrive()
        elif event < 0.25 and len(seqs.running) > 1:
            for _ in range(rng.randint(1, len(seqs.running) - 1)):
                seqs.leave()
        elif event < 0.3:
            rng.shuffle(seqs.running)  # rows change places (the scheduler's order changed)
        step, params = seqs.step()
        size = next(b for b in buckets if b >= step.num_seqs)
        sizes.add(size)
        on_device = rng.random() < 0.2  # tokens a pass before drew, not read by the host
        if on_device:
            step.input_ids = torch.from_numpy(step.input_ids)
        before = inputs.field("seq_lens", size).clone()
        inputs.update(step, size, params, DEFAULTS)
        check_against_rebuild(inputs, step, params, size)
        if event >= 0.3 and not on_device and n and not again:  # every row decodes again: tokens, new blocks
            new_blocks = sum(len(s["table"]) > -(-s["computed"] // BLOCK) for s in seqs.running)
            steady_patches.append((inputs.patched, step.num_seqs + new_blocks))
            b = step.num_seqs
            assert torch.equal(inputs.field("seq_lens", size)[:b], before[:b] + 1)
        again = seqs.decode()
    assert sizes == set(buckets)  # every bucket was used
    assert all(patched <= bound for patched, bound in steady_patches) and len(steady_patches) > 100


def test_fits_only_decode_steps_of_its_shape():
    seqs = Sequences(random.Random(1))
    for _ in range(3):
        seqs.arrive()
    step, _ = seqs.step()
    inputs = DecodeInputs(MAX_BATCH, MAX_BLOCKS, BLOCK, torch.device("cpu"))
    assert inputs.fits(step)
    assert not DecodeInputs(2, MAX_BLOCKS, BLOCK, torch.device("cpu")).fits(step)  # more rows than it holds
    positions = step.positions
    step.positions = positions - 1  # a position not its context length - 1 (a token tree's depth)
    assert not inputs.fits(step)
    step.positions = np.stack([positions - 4] * 3)  # M-RoPE: a text token's three alike, after an image (delta -4)
    assert inputs.fits(step)
    inputs.update(step, 4)
    assert inputs.positions_and_slots(4)[0][:3].tolist() == (positions - 4).tolist()
    step.positions = np.stack([positions, positions + 1, positions])  # an image's token: not the graphs'
    assert not inputs.fits(step)
