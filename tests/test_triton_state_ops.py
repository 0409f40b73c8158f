"""The state layers' Triton kernels (hearth/triton_kernels/state_ops.py) against the torch definition
(hearth/backend/state_ops.py, itself tested against transformers in tests/test_hybrid_models.py), on one
step that mixes every kind of sequence, then a step of decodes only that carries on from it:

  a prompt of 37 rows from a zero state (two chunks of the kernel's 32, the reference's one of 64), a chunk
  of 20 rows carrying its slot's state, a decode, a one-token prompt whose slot holds an old sequence's
  state (it must start from zero), a verification of 4 rows keeping the states after its first 3 in
  snapshot rows, and a CUDA graph's padding row (context 0) on slot 0, which a real sequence owns: it
  must leave that state alone.

Every state row (slots and snapshots) and every live row's output must equal the reference's to 1e-5.
Without a GPU the kernels run in Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from hearth.backend import state_ops as reference
from hearth.triton_kernels import state_ops as kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# per sequence: (rows, context after the step, slot, first snapshot row or -1); the last is graph padding
MIXED = [(37, 37, 2, -1), (20, 31, 0, -1), (1, 9, 3, -1), (1, 1, 1, -1), (4, 14, 4, 6), (1, 0, 0, -1)]
SLOTS = 9  # 5 running slots and 3 snapshot rows (6..8), one spare


def _steps():
    """(kernel rows, reference metadata, live rows) of the mixed step, then of a step of decodes only
    (one row per live sequence, padding again on slot 0)."""
    decodes = [(1, length + 1, slot, -1) for _, length, slot, _ in MIXED[:-1]] + [(1, 0, 0, -1)]
    return [_step(MIXED), _step(decodes)]


def _step(sequences):
    """A step's StateRows for the kernels, the reference's StateMetadata (the padding row left out), live rows."""
    query_lens, seq_lens, slots, snapshots = (np.array(column) for column in zip(*sequences))
    query_start_loc = np.concatenate(([0], np.cumsum(query_lens))).astype(np.int32)
    has_snapshots = (snapshots >= 0).any()

    def dev(a, dtype):
        return torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE, dtype)

    rows = kernels.StateRows(dev(slots, torch.int32), dev(query_start_loc, torch.int32), dev(seq_lens, torch.int32),
                             int(query_lens.max()), dev(snapshots, torch.int64) if has_snapshots else None)
    live = len(sequences) - 1  # (the padding row, last, is no sequence of the reference's)
    meta = reference.StateMetadata.from_step(slots[:live], query_start_loc[: live + 1], seq_lens[:live].astype(np.int32),
                                             torch.device(DEVICE), snapshots[:live] if has_snapshots else None)
    return rows, meta, int(query_start_loc[live])


def _compare(run_kernel, run_reference, state: torch.Tensor, make_inputs) -> None:
    """Both over the two steps from the same state: the live rows' outputs and every state row.
    make_inputs(tokens) -> the step's input tensors."""
    ours, theirs = state.clone(), state.clone()
    for rows, meta, live in _steps():
        inputs = make_inputs(int(rows.query_start_loc[-1]))
        out = run_kernel(*inputs, ours, rows)
        torch.testing.assert_close(out[:live], run_reference(*inputs, theirs, meta)[:live], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_causal_conv1d_matches_the_reference():
    """With a bias and SiLU (Mamba2's; LFM2's has no activation, Gated DeltaNet's no bias: the end-to-end
    tests in test_gpu_backend.py), channels past a program's 128 (200), inputs a strided view of a wider
    projection, K = 4."""
    gen = torch.Generator().manual_seed(0)
    channels, kernel = 200, 4
    weight, bias = torch.randn(channels, kernel, generator=gen).to(DEVICE), torch.randn(channels, generator=gen).to(DEVICE)
    state = torch.randn(SLOTS, channels, kernel - 1, generator=gen).to(DEVICE)  # old states in every row
    _compare(lambda x, s, rows: kernels.causal_conv1d(x, s, weight, bias, rows, "silu"),
             lambda x, s, meta: reference.causal_conv1d(x, s, weight, bias, meta, "silu"), state,
             lambda tokens: (torch.randn(tokens, channels + 24, generator=gen).to(DEVICE)[:, 8:-16],))


def _recurrence_inputs(gen, heads: int, dk: int, dv: int, beta: bool):
    """make_inputs for the recurrences: q, k L2-normalised (as the layers make them), the keys alike (as
    neighbouring tokens' are: a chunk's solve is ill-conditioned, where a careless inverse loses its
    digits), slow decays and betas near 1 (which keep it so)."""
    alike = torch.randn(heads, dk, generator=gen)

    def make(tokens):
        q = F.normalize(torch.randn(tokens, heads, dk, generator=gen), dim=-1)
        k = F.normalize(alike + 0.1 * torch.randn(tokens, heads, dk, generator=gen), dim=-1)
        v = torch.randn(tokens, heads, dv, generator=gen)
        g = -0.05 * torch.rand(tokens, heads, generator=gen)
        extra = (0.5 + 0.5 * torch.rand(tokens, heads, generator=gen),) if beta else ()
        return tuple(t.to(DEVICE) for t in (q, k, v, g, *extra))
    return make


def test_gated_delta_rule_matches_the_reference():
    """2 heads, key dim 8 (padded to tl.dot's 16), value dim 40 (two programs of 32 columns)."""
    gen = torch.Generator().manual_seed(1)
    state = torch.randn(SLOTS, 2, 8, 40, generator=gen).to(DEVICE)
    _compare(kernels.gated_delta_rule, reference.gated_delta_rule, state,
             _recurrence_inputs(gen, 2, 8, 40, beta=True))


def test_ssm_scan_matches_the_reference():
    """Mamba2's scan: 3 heads, state size 8, head dim 12."""
    gen = torch.Generator().manual_seed(2)
    state = torch.randn(SLOTS, 3, 8, 12, generator=gen).to(DEVICE)
    _compare(kernels.ssm_scan, reference.ssm_scan, state,
             _recurrence_inputs(gen, 3, 8, 12, beta=False))
