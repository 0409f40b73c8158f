"""The operations of the layers that keep a state per sequence (hybrid models, hearth/model/state_layers.py),
in torch: the causal depthwise convolution and the gated delta rule, each reading and writing the
sequences' states in the state cache through their state slots.

A step's sequences are of two kinds. Those with one new row (decodes) are computed together: their
states gathered by slot, one step of the recurrence for all, scattered back. Those with several (a
prompt or a chunk of one) are computed one by one in the chunked form, from the state their last
chunk left. A sequence whose first new row is position 0 starts from a zero state, whatever its slot
held before (slots are reused without being cleared).

A sequence verifying speculative guesses (its first row the token before them) may name a snapshot
slot: its rows then run one recurrent step each (as decodes do), and the state after each row but the
last is written to the snapshot slots from that one on, so that the runner can put back the state at
the last accepted guess (a rejected guess must not stay in the state: ModelRunner._kept_tokens).

The gated delta rule (Gated DeltaNet, Yang et al. 2024), per value head: with a_t = exp(g_t),
    S_t = a_t S_{t-1} + k_t d_t^T,  d_t = beta_t (v_t - a_t S_{t-1}^T k_t),  o_t = S_t^T q_t
(S [key dim, value dim]). Within a chunk of rows 1..m, with G_i = g_1 + ... + g_i, unrolling gives
    (I + A) D = beta V - (beta K e^G) S_0,  A_ij = beta_i (k_i . k_j) e^{G_i - G_j} for j < i
so the chunk's d's come from one unit-lower-triangular solve, and then
    o_i = e^{G_i} S_0^T q_i + sum_{j <= i} e^{G_i - G_j} (q_i . k_j) d_j,
    S_m = e^{G_m} S_0 + sum_j e^{G_m - G_j} k_j d_j^T:
matrix products over the chunk instead of m dependent steps.

Mamba2's selective scan (its SSD, Dao and Gu 2024) is the same recurrence without the delta: per head,
with q = C, k = B, v = dt x and g = dt A, S_t = a_t S_{t-1} + k_t v_t^T and o_t = S_t^T q_t, so that
within a chunk D = V and no solve is needed (ssm_scan, chunked_ssm).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

DELTA_RULE_CHUNK = 64  # rows per chunk of the chunked form (the solve is chunk x chunk)


@dataclass
class StateMetadata:
    """Which state slot each sequence of a step reads and writes, and its rows."""

    slots: list[int]  # per sequence
    starts: list[int]  # [S + 1]: sequence s owns rows starts[s]..starts[s + 1] - 1
    fresh: list[bool]  # per sequence: its first new row is position 0 (its state starts at zero)
    single_rows: torch.Tensor  # long [D]: the rows of the sequences with one new row
    single_slots: torch.Tensor  # long [D]: their slots
    single_fresh: torch.Tensor  # bool [D]: which of them start at zero
    # per sequence: the first of the slots where the states after each of its rows but the last go (-1: none)
    snapshots: list[int] | None = None

    @classmethod
    def from_step(cls, state_slots: np.ndarray, query_start_loc: np.ndarray, seq_lens: np.ndarray,
                  device: torch.device, snapshots: np.ndarray | None = None) -> StateMetadata:
        query_lens = np.diff(query_start_loc)
        fresh = (seq_lens - query_lens) == 0
        single = np.flatnonzero(query_lens == 1)

        def tensor(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(values)).to(device=device, dtype=dtype)

        return cls(state_slots.tolist(), query_start_loc.tolist(), fresh.tolist(),
                   tensor(query_start_loc[single], torch.long), tensor(state_slots[single], torch.long),
                   tensor(fresh[single], torch.bool), None if snapshots is None else snapshots.tolist())

    def several_rows(self):
        """(first row, end row, slot, fresh, first snapshot slot or -1) of each sequence with several new rows."""
        for s, slot in enumerate(self.slots):
            start, end = self.starts[s], self.starts[s + 1]
            if end - start > 1:
                yield start, end, slot, self.fresh[s], -1 if self.snapshots is None else self.snapshots[s]


def _previous(state: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
    """The single-row sequences' states, zero for those that start here."""
    previous = state[meta.single_slots]
    return torch.where(meta.single_fresh.view(-1, *[1] * (previous.dim() - 1)), 0.0, previous)


def causal_conv1d(
    x: torch.Tensor,  # [T, C]
    state: torch.Tensor,  # [slots, C, K - 1]: each sequence's last K - 1 inputs per channel, oldest first
    weight: torch.Tensor,  # [C, K]
    bias: torch.Tensor | None,  # [C]
    meta: StateMetadata,
    activation: str | None = None,  # "silu" or None
    step=None,  # the single-row sequences' step (a backend's kernel); None: conv1d_step
) -> torch.Tensor:  # [T, C]
    """Each channel convolved with its K taps over the sequence's inputs so far (the window before
    the step's rows from the state); the state keeps the last K - 1 inputs."""
    out = torch.empty_like(x)
    width = weight.shape[1] - 1
    if meta.single_rows.numel():
        out[meta.single_rows] = (step or conv1d_step)(x[meta.single_rows], state, weight, bias, meta)
    for start, end, slot, fresh, snapshot in meta.several_rows():
        previous = x.new_zeros(x.shape[1], width) if fresh else state[slot].to(x.dtype)
        window = torch.cat([previous, x[start:end].t()], dim=1)  # [C, K - 1 + n]
        y = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1), bias, groups=x.shape[1])[0]  # [C, n]
        # the window after each row: [n + 1, C, K - 1], the first the one before the rows
        _keep(state, slot, snapshot, window.unfold(1, width, 1)[:, 1:].transpose(0, 1).to(state.dtype))
        out[start:end] = y.t()
    return F.silu(out) if activation == "silu" else out


def conv1d_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                meta: StateMetadata) -> torch.Tensor:
    """The single-row sequences' convolution: x [D, C], their windows gathered by slot and put back
    shifted -> [D, C] (no activation)."""
    window = torch.cat([_previous(state, meta).to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [D, C, K]
    state[meta.single_slots] = window[..., 1:].to(state.dtype)
    y = (window * weight).sum(-1)
    return y if bias is None else y + bias


def gated_delta_rule(
    q: torch.Tensor,  # [T, H, dk] float32, per value head (normalised and scaled by the layer)
    k: torch.Tensor,  # [T, H, dk] float32
    v: torch.Tensor,  # [T, H, dv] float32
    g: torch.Tensor,  # [T, H] float32: log of each row's decay (<= 0)
    beta: torch.Tensor,  # [T, H] float32
    state: torch.Tensor,  # [slots, H, dk, dv] float32
    meta: StateMetadata,
    step=None,  # the single-row sequences' step (a backend's kernel); None: delta_rule_step
) -> torch.Tensor:  # [T, H, dv] float32
    """The gated delta rule over the step's rows (the module's docstring): one recurrent step for
    the sequences with one new row, the chunked form for the others."""
    return _over_rows((q, k, v, g, beta), state, meta, step or delta_rule_step, chunked_delta_rule, recurrent_step)


def delta_rule_step(q, k, v, g, beta, state: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
    """The single-row sequences' step (q, k [D, H, dk], v [D, H, dv], g, beta [D, H]): their states
    gathered by slot, one step each, put back -> [D, H, dv]."""
    out, state[meta.single_slots] = recurrent_step(q, k, v, g, beta, _previous(state, meta))
    return out


def recurrent_step(q, k, v, g, beta, S):
    """One row per sequence: q, k [B, H, dk], v [B, H, dv], g, beta [B, H], S [B, H, dk, dv] ->
    (o [B, H, dv], the new S)."""
    S = S * g.exp()[..., None, None]
    delta = (v - torch.einsum("bhk,bhkv->bhv", k, S)) * beta[..., None]
    S = S + k[..., None] * delta[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, S), S


def chunked_delta_rule(q, k, v, g, beta, S, chunk: int = DELTA_RULE_CHUNK):
    """One sequence's rows: q, k [n, H, dk], v [n, H, dv], g, beta [n, H], S [H, dk, dv] ->
    (o [n, H, dv], the state after the last row)."""
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [H, n, d]
    g, beta = g.t(), beta.t()  # [H, n]
    outputs = []
    for first in range(0, q.shape[1], chunk):
        rows = slice(first, first + chunk)
        qc, kc, vc, bc = q[:, rows], k[:, rows], v[:, rows], beta[:, rows, None]
        decay = g[:, rows].cumsum(-1)  # [H, m]: G_i
        m = decay.shape[1]
        causal = torch.ones(m, m, dtype=torch.bool, device=q.device).tril()
        pairwise = (decay[:, :, None] - decay[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # e^{G_i - G_j}
        system = ((kc * bc) @ kc.transpose(-1, -2) * pairwise).tril(-1) + torch.eye(m, device=q.device)
        u = torch.linalg.solve_triangular(system, vc * bc, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, kc * bc * decay.exp()[..., None], upper=False, unitriangular=True)
        deltas = u - w @ S  # [H, m, dv]
        outputs.append((qc * decay.exp()[..., None]) @ S + (qc @ kc.transpose(-1, -2) * pairwise) @ deltas)
        last = decay[:, -1:]  # [H, 1]
        S = S * last.exp()[..., None] + (kc * (last - decay).exp()[..., None]).transpose(-1, -2) @ deltas
    return torch.cat(outputs, dim=1).transpose(0, 1), S


def ssm_scan(
    q: torch.Tensor,  # [T, H, n] float32 (Mamba2's C, per head)
    k: torch.Tensor,  # [T, H, n] float32 (B)
    v: torch.Tensor,  # [T, H, p] float32 (dt x)
    g: torch.Tensor,  # [T, H] float32: log of each row's decay (dt A, <= 0)
    state: torch.Tensor,  # [slots, H, n, p] float32
    meta: StateMetadata,
    step=None,  # the single-row sequences' step (a backend's kernel); None: ssm_step
) -> torch.Tensor:  # [T, H, p] float32
    """Mamba2's selective scan over the step's rows (the module's docstring): one recurrent step for the
    sequences with one new row, the chunked form for the others."""
    return _over_rows((q, k, v, g), state, meta, step or ssm_step, chunked_ssm, ssm_recurrent_step)


def _over_rows(inputs: tuple[torch.Tensor, ...], state: torch.Tensor, meta: StateMetadata, single_step, chunked,
               recurrent) -> torch.Tensor:
    """A recurrence (the delta rule's, Mamba2's) over the step's rows, inputs (q, k, v, ...) [T, H, ...]:
    single_step for the sequences with one new row; the chunked form for the others, or row by row where
    a verification keeps the state after each row (its snapshots) -> [T, H, v's last dimension]."""
    out = torch.empty_like(inputs[2])
    if meta.single_rows.numel():
        rows = meta.single_rows
        out[rows] = single_step(*(t[rows] for t in inputs), state, meta)
    for start, end, slot, fresh, snapshot in meta.several_rows():
        initial = state.new_zeros(state.shape[1:]) if fresh else state[slot]
        rows = tuple(t[start:end] for t in inputs)
        if snapshot < 0:
            out[start:end], state[slot] = chunked(*rows, initial)
        else:
            out[start:end], states = _row_by_row(recurrent, rows, initial)
            _keep(state, slot, snapshot, states)
    return out


def ssm_step(q, k, v, g, state: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
    """The single-row sequences' step (q, k [D, H, n], v [D, H, p], g [D, H]): their states gathered by
    slot, one step each, put back -> [D, H, p]."""
    out, state[meta.single_slots] = ssm_recurrent_step(q, k, v, g, _previous(state, meta))
    return out


def ssm_recurrent_step(q, k, v, g, S):
    """One row per sequence: q, k [B, H, n], v [B, H, p], g [B, H], S [B, H, n, p] -> (o [B, H, p], the new
    S): S = e^g S + k v^T and o = S^T q."""
    S = S * g.exp()[..., None, None] + k[..., None] * v[..., None, :]
    return torch.einsum("bhn,bhnp->bhp", q, S), S


def _row_by_row(step, rows: tuple[torch.Tensor, ...], S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A verifying sequence's rows (each tensor [n, H, ...]) one recurrent step each from state S [H, ...]:
    (outputs [n, H, ...], the states after each row [n, H, ...])."""
    outputs, states = [], []
    for row in zip(*rows):
        o, S = step(*(t[None] for t in row), S[None])
        outputs.append(o[0])
        states.append(S := S[0])
    return torch.stack(outputs), torch.stack(states)


def _keep(state: torch.Tensor, slot: int, snapshot: int, after: torch.Tensor) -> None:
    """A sequence's states after each of its n rows (after [n, ...]): the last into its slot, the others
    into the snapshot slots from `snapshot` on where it names them."""
    state[slot] = after[-1]
    if snapshot >= 0:
        state[snapshot : snapshot + len(after) - 1] = after[:-1]


def chunked_ssm(q, k, v, g, S, chunk: int = DELTA_RULE_CHUNK):
    """One sequence's rows: q, k [n_rows, H, n], v [n_rows, H, p], g [n_rows, H], S [H, n, p] -> (o [n_rows,
    H, p], the state after the last row)."""
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [H, rows, d]
    g = g.t()  # [H, rows]
    outputs = []
    for first in range(0, q.shape[1], chunk):
        rows = slice(first, first + chunk)
        qc, kc, vc = q[:, rows], k[:, rows], v[:, rows]
        decay = g[:, rows].cumsum(-1)  # [H, m]: G_i
        m = decay.shape[1]
        causal = torch.ones(m, m, dtype=torch.bool, device=q.device).tril()
        pairwise = (decay[:, :, None] - decay[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # e^{G_i - G_j}
        outputs.append((qc * decay.exp()[..., None]) @ S + (qc @ kc.transpose(-1, -2) * pairwise) @ vc)
        last = decay[:, -1:]  # [H, 1]
        S = S * last.exp()[..., None] + (kc * (last - decay).exp()[..., None]).transpose(-1, -2) @ vc
    return torch.cat(outputs, dim=1).transpose(0, 1), S
