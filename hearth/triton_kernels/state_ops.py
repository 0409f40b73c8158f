"""The state layers' operations (hybrid models) as Triton kernels: the causal depthwise convolution with
its rolling window, and the gated delta rule and Mamba2's scan in their recurrent form (decodes) and
chunked form (prompts and chunks). hearth/backend/state_ops.py is the torch definition they are tested
against, and its docstring writes out the maths.

Each operation takes the whole step in one or two launches, reading only device tensors (`StateRows`):
sequence s owns rows query_start_loc[s]..query_start_loc[s + 1] - 1 and state row slots[s]; it starts
from a zero state where its first new row is position 0 (seq_lens[s] equals its rows: slots are reused
without being cleared); a sequence of seq_lens 0 is a CUDA graph's padding row (hearth/backend/
decode_inputs.py), computed from a zero state and never written back. Nothing is read on the host, so
a decode step's kernels are captured in its graph, the state rows addressed by the slots buffer.

- The convolution: `_conv1d_kernel` computes every row from the step's inputs and, before a sequence's
  first row, its slot's window (the last K - 1 inputs); then `_window_kernel` writes each slot's new
  window (a sequence with fewer than K - 1 rows keeps part of the old one), after every row has read
  the old windows (a second launch: programs of one launch run in no set order).
- The recurrences (per head, S [key dim, value dim]): a sequence with one new row, or one verifying
  speculative guesses (snapshots[s] >= 0: the states after each of its rows but the last go to state
  rows snapshots[s] on, state_ops.py's snapshots), runs `_recurrent_kernel`, a row at a time; any other
  (a prompt, a chunk) runs `_chunked_kernel`, CHUNK rows at a time with the state carried in registers.
  Both are launched over every sequence and skip the other's (a decode step launches only the first).
  One program holds a head's state for BLOCK_V of its value columns. The delta rule's chunk solve
  (I + A) D = ... (A strictly lower triangular) inverts I + A by forward substitution, a row of the
  inverse at a time from those before it (elementwise work on a CHUNK x CHUNK tile), then matrix products.
  float32 throughout (the layers hand the recurrences float32), products in IEEE fp32, not tf32.

Tested under Triton's interpreter only (tests/test_triton_state_ops.py); not yet compiled or timed on a
GPU, so the tile sizes below are first choices, not measured ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

CHUNK = 32  # rows per chunk of the chunked form (a power of two, at least tl.dot's 16)
CONV_ROWS = 32  # rows per program of the convolution
CONV_CHANNELS = 128  # channels per program of the convolution
VALUE_COLUMNS = 32  # value columns of a head's state per program of the recurrences


@dataclass
class StateRows:
    """A step's sequences as the state kernels read them: device tensors, and one host int for grids."""

    slots: torch.Tensor  # int [S]: each sequence's row in the state tensors
    query_start_loc: torch.Tensor  # int32 [S + 1]: sequence s owns rows [start[s], start[s + 1])
    seq_lens: torch.Tensor  # int32 [S]: its context after the step, new rows included (0: a graph's padding row)
    max_query_len: int  # the most rows of any sequence
    # int64 [S]: the first state row of each sequence's snapshots (-1: none); None: no sequence keeps any
    snapshots: torch.Tensor | None = None


@triton.jit
def _sequence(query_start_loc_ptr, seq_lens_ptr, s):
    """(first row, rows, whether it carries a state from before, whether it is live) of sequence s."""
    start = tl.load(query_start_loc_ptr + s)
    rows = tl.load(query_start_loc_ptr + s + 1) - start
    seq_len = tl.load(seq_lens_ptr + s)
    return start, rows, seq_len > rows, seq_len > 0


@triton.jit
def _below(flag, bound):
    """bound where the scalar flag holds, else 0: a mask `index < _below(flag, n)` is `index < n` and the flag
    (Triton's interpreter makes `mask & flag` int32, which a load refuses as a mask)."""
    return tl.where(flag, bound, 0)


# ---- the causal depthwise convolution ---------------------------------------------------


@triton.jit
def _conv1d_kernel(x_ptr, state_ptr, weight_ptr, bias_ptr, out_ptr, slots_ptr, query_start_loc_ptr, seq_lens_ptr,
                   channels, stride_x, KERNEL: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    s = tl.program_id(0)
    start, rows, carried, _ = _sequence(query_start_loc_ptr, seq_lens_ptr, s)
    window_at = state_ptr + tl.load(slots_ptr + s).to(tl.int64) * channels * (KERNEL - 1)
    earliest = -_below(carried, KERNEL - 1)  # the first input a row may read, by row of the sequence
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # rows of the sequence
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok, c_ok = t < rows, c < channels
    acc = tl.zeros((BLOCK_T, BLOCK_C), tl.float32)
    for tap in tl.static_range(KERNEL):
        r = t - (KERNEL - 1) + tap  # the input this tap reads, by row of the sequence (< 0: from the window)
        xs = tl.load(x_ptr + (start + r).to(tl.int64)[:, None] * stride_x + c[None, :],
                     mask=(t_ok & (r >= 0))[:, None] & c_ok[None, :], other=0.0)
        old = tl.load(window_at + c[None, :] * (KERNEL - 1) + (KERNEL - 1 + r)[:, None],
                      mask=(t_ok & (r < 0) & (r >= earliest))[:, None] & c_ok[None, :], other=0.0)
        w = tl.load(weight_ptr + c * KERNEL + tap, mask=c_ok, other=0.0).to(tl.float32)
        acc += (xs.to(tl.float32) + old.to(tl.float32)) * w[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + (start + t).to(tl.int64)[:, None] * channels + c[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & c_ok[None, :])


@triton.jit
def _window_after(x_ptr, window_at, start, carried, last, c, i, c_ok, stride_x, KERNEL: tl.constexpr):
    """A sequence's window after its row `last` ([BLOCK_C, BLOCK_W] float32: its inputs last - K + 2 ..
    last, those before its first row from the window at window_at)."""
    r = last - (KERNEL - 2) + i  # [BLOCK_W] by row of the sequence
    xs = tl.load(x_ptr + (start + r).to(tl.int64)[None, :] * stride_x + c[:, None],
                 mask=c_ok[:, None] & ((r >= 0) & (i < KERNEL - 1))[None, :], other=0.0)
    old = tl.load(window_at + c[:, None] * (KERNEL - 1) + (KERNEL - 1 + r)[None, :],
                  mask=c_ok[:, None] & ((r < 0) & (r >= -_below(carried, KERNEL - 1)))[None, :], other=0.0)
    return xs.to(tl.float32) + old.to(tl.float32)


@triton.jit
def _window_kernel(x_ptr, state_ptr, slots_ptr, snapshots_ptr, query_start_loc_ptr, seq_lens_ptr, channels, stride_x,
                   KERNEL: tl.constexpr, HAS_SNAPSHOTS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr):
    s = tl.program_id(0)
    start, rows, carried, live = _sequence(query_start_loc_ptr, seq_lens_ptr, s)
    row_size = channels * (KERNEL - 1)
    window_at = state_ptr + tl.load(slots_ptr + s).to(tl.int64) * row_size
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    i = tl.arange(0, BLOCK_W)
    c_ok = c < channels
    tile, tile_ok = c[:, None] * (KERNEL - 1) + i[None, :], c_ok[:, None] & (i < KERNEL - 1)[None, :]
    if HAS_SNAPSHOTS:  # the windows after each row but the last, into the snapshot rows
        first = tl.load(snapshots_ptr + s)
        for row in range(0, tl.where(live & (first >= 0), rows - 1, 0)):
            window = _window_after(x_ptr, window_at, start, carried, row, c, i, c_ok, stride_x, KERNEL)
            tl.store(state_ptr + (first + row) * row_size + tile, window.to(state_ptr.dtype.element_ty), mask=tile_ok)
    window = _window_after(x_ptr, window_at, start, carried, rows - 1, c, i, c_ok, stride_x, KERNEL)
    tl.debug_barrier()  # every thread's loads of the old window before any store over it
    live_ok = (c < _below(live, channels))[:, None] & (i < KERNEL - 1)[None, :]
    tl.store(window_at + tile, window.to(state_ptr.dtype.element_ty), mask=live_ok)


def causal_conv1d(
    x: torch.Tensor,  # [T, C], rows may be strided (a view of a merged projection)
    state: torch.Tensor,  # [state rows, C, K - 1] contiguous: each sequence's last K - 1 inputs, oldest first
    weight: torch.Tensor,  # [C, K]
    bias: torch.Tensor | None,  # [C]
    rows: StateRows,
    activation: str | None = None,  # "silu" or None
) -> torch.Tensor:  # [T, C] in x's dtype
    """Each channel convolved with its K taps over the sequence's inputs so far; the state keeps the
    last K - 1 (and, for a sequence verifying guesses, the windows after each row in its snapshot rows)."""
    assert x.dim() == 2 and x.stride(1) == 1 and state.is_contiguous() and activation in (None, "silu")
    tokens, channels = x.shape
    kernel = weight.shape[1]
    out = torch.empty((tokens, channels), dtype=x.dtype, device=x.device)
    sequences = len(rows.seq_lens)
    if tokens == 0:
        return out
    weight = weight.contiguous()
    grid = (sequences, triton.cdiv(rows.max_query_len, CONV_ROWS), triton.cdiv(channels, CONV_CHANNELS))
    _conv1d_kernel[grid](x, state, weight, bias if bias is not None else weight, out, rows.slots,
                         rows.query_start_loc, rows.seq_lens, channels, x.stride(0), KERNEL=kernel,
                         HAS_BIAS=bias is not None, SILU=activation == "silu", BLOCK_T=CONV_ROWS,
                         BLOCK_C=CONV_CHANNELS, num_warps=4)
    snapshots = rows.snapshots
    _window_kernel[(sequences, triton.cdiv(channels, CONV_CHANNELS))](
        x, state, rows.slots, snapshots if snapshots is not None else rows.slots, rows.query_start_loc, rows.seq_lens,
        channels, x.stride(0), KERNEL=kernel, HAS_SNAPSHOTS=snapshots is not None, BLOCK_C=CONV_CHANNELS,
        BLOCK_W=triton.next_power_of_2(kernel - 1), num_warps=4)
    return out


# ---- the gated delta rule and Mamba2's scan ------------------------------------------------


@triton.jit
def _recurrence_start(state_ptr, slots_ptr, snapshots_ptr, query_start_loc_ptr, seq_lens_ptr, heads, DK, DV,
                      HAS_SNAPSHOTS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """A program's sequence and its head's state: (start, rows, live, first snapshot row (-1: none), where
    its state row is and its tile's offsets [BLOCK_K, BLOCK_V], the state it starts from)."""
    s, h = tl.program_id(0), tl.program_id(1)
    start, rows, carried, live = _sequence(query_start_loc_ptr, seq_lens_ptr, s)
    if HAS_SNAPSHOTS:
        first = tl.load(snapshots_ptr + s)
    else:
        first = tl.full((), -1, tl.int64)
    kk, vv = tl.arange(0, BLOCK_K), tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    tile = h * DK * DV + kk[:, None] * DV + vv[None, :]
    slot_at = state_ptr + tl.load(slots_ptr + s).to(tl.int64) * heads * DK * DV
    S = tl.load(slot_at + tile, mask=_tile_mask(kk, vv, DK, DV, carried), other=0.0)
    return start, rows, live, first, slot_at, tile, S


@triton.jit
def _tile_mask(kk, vv, DK, DV, flag):
    """[BLOCK_K, BLOCK_V]: within the state's dimensions, where the scalar flag holds."""
    return (kk < _below(flag, DK))[:, None] & (vv < DV)[None, :]


@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, slots_ptr, snapshots_ptr,
                      query_start_loc_ptr, seq_lens_ptr, heads, DK, DV, HAS_BETA: tl.constexpr,
                      HAS_SNAPSHOTS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    start, rows, live, first, slot_at, tile, S = _recurrence_start(
        state_ptr, slots_ptr, snapshots_ptr, query_start_loc_ptr, seq_lens_ptr, heads, DK, DV, HAS_SNAPSHOTS,
        BLOCK_K, BLOCK_V)
    mine = (rows == 1) | (first >= 0)  # (the others: _chunked_kernel's)
    h = tl.program_id(1)
    kk, vv = tl.arange(0, BLOCK_K), tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    for r in range(0, tl.where(mine, rows, 0)):
        at = (start + r).to(tl.int64) * heads + h  # the row's head, in [T, H] and (times dims) [T, H, d]
        q = tl.load(q_ptr + at * DK + kk, mask=kk < DK, other=0.0)
        k = tl.load(k_ptr + at * DK + kk, mask=kk < DK, other=0.0)
        v = tl.load(v_ptr + at * DV + vv, mask=vv < DV, other=0.0)
        S = S * tl.exp(tl.load(g_ptr + at))
        if HAS_BETA:  # the delta: what the state already gives for k, taken away
            v = (v - tl.sum(S * k[:, None], 0)) * tl.load(beta_ptr + at)
        S = S + k[:, None] * v[None, :]
        tl.store(out_ptr + at * DV + vv, tl.sum(S * q[:, None], 0), mask=vv < DV)
        if HAS_SNAPSHOTS:
            tl.store(state_ptr + (first + r) * heads * DK * DV + tile, S, mask=_tile_mask(kk, vv, DK, DV, r < rows - 1))
    tl.store(slot_at + tile, S, mask=_tile_mask(kk, vv, DK, DV, live & mine))


@triton.jit
def _unit_lower_inverse(a, t, CHUNK: tl.constexpr):
    """(I + a)^-1 for a strictly lower triangular [CHUNK, CHUNK], by forward substitution a row at a time:
    row i of the inverse is e_i - sum_{j < i} a_ij (row j). (The product form (I - a)(I + a^2)(I + a^4)...
    is a few matrix products but loses everything to cancellation where neighbouring keys are alike.)"""
    inverse = -a  # rows before i: the inverse's strictly lower part; rows from i on: -a's
    for i in range(1, CHUNK):
        at_i = t[:, None] == i
        row = tl.sum(tl.where(at_i, inverse, 0.0), 0)  # -a_i, nonzero before column i only
        inverse = tl.where(at_i, (row + tl.sum(row[:, None] * inverse, 0))[None, :], inverse)
    return inverse + tl.where(t[:, None] == t[None, :], 1.0, 0.0)


@triton.jit
def _chunk_deltas(k, v, beta, G, decay, S, t, CHUNK: tl.constexpr):
    """The delta rule's d's of a chunk [CHUNK, BLOCK_V]: (I + A) D = beta V - (beta K e^G) S_0."""
    kb = k * beta[:, None]
    a = tl.where(t[:, None] > t[None, :], tl.dot(kb, tl.trans(k), input_precision="ieee") * decay, 0.0)
    inverse = _unit_lower_inverse(a, t, CHUNK)
    u = tl.dot(inverse, v * beta[:, None], input_precision="ieee")
    w = tl.dot(inverse, kb * tl.exp(G)[:, None], input_precision="ieee")
    return u - tl.dot(w, S, input_precision="ieee")


@triton.jit
def _chunked_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, slots_ptr, snapshots_ptr,
                    query_start_loc_ptr, seq_lens_ptr, heads, DK, DV, HAS_BETA: tl.constexpr,
                    HAS_SNAPSHOTS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_V: tl.constexpr):
    start, rows, live, first, slot_at, tile, S = _recurrence_start(
        state_ptr, slots_ptr, snapshots_ptr, query_start_loc_ptr, seq_lens_ptr, heads, DK, DV, HAS_SNAPSHOTS,
        BLOCK_K, BLOCK_V)
    mine = (rows > 1) & (first < 0)  # (the others: _recurrent_kernel's)
    h = tl.program_id(1)
    kk, vv, t = tl.arange(0, BLOCK_K), tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V), tl.arange(0, CHUNK)
    for chunk in range(0, tl.where(mine, tl.cdiv(rows, CHUNK), 0)):
        ok = chunk * CHUNK + t < rows
        at = (start + chunk * CHUNK + t).to(tl.int64) * heads + h  # [CHUNK]
        k_tile, v_tile = ok[:, None] & (kk < DK)[None, :], ok[:, None] & (vv < DV)[None, :]
        q = tl.load(q_ptr + at[:, None] * DK + kk[None, :], mask=k_tile, other=0.0)
        k = tl.load(k_ptr + at[:, None] * DK + kk[None, :], mask=k_tile, other=0.0)
        v = tl.load(v_ptr + at[:, None] * DV + vv[None, :], mask=v_tile, other=0.0)
        G = tl.cumsum(tl.load(g_ptr + at, mask=ok, other=0.0), 0)  # rows past the sequence add 0
        decay = tl.exp(tl.where(t[:, None] >= t[None, :], G[:, None] - G[None, :], float("-inf")))  # e^{G_i - G_j}
        if HAS_BETA:
            v = _chunk_deltas(k, v, tl.load(beta_ptr + at, mask=ok, other=0.0), G, decay, S, t, CHUNK)
        out = tl.dot(q * tl.exp(G)[:, None], S, input_precision="ieee") + \
            tl.dot(tl.dot(q, tl.trans(k), input_precision="ieee") * decay, v, input_precision="ieee")
        tl.store(out_ptr + at[:, None] * DV + vv[None, :], out, mask=v_tile)
        last = tl.sum(tl.where(t == CHUNK - 1, G, 0.0), 0)  # G at the chunk's last row
        S = S * tl.exp(last) + tl.dot(tl.trans(k * tl.exp(last - G)[:, None]), v, input_precision="ieee")
    tl.store(slot_at + tile, S, mask=_tile_mask(kk, vv, DK, DV, live & mine))


def _recurrence(q, k, v, g, beta, state, rows: StateRows) -> torch.Tensor:
    """The delta rule (beta given) or Mamba2's scan (beta None) over the step's rows: the recurrent kernel
    for sequences with one row or snapshots, the chunked one for the others -> [T, H, dv] float32."""
    tokens, heads, dk = q.shape
    dv = v.shape[-1]
    assert state.is_contiguous() and state.shape[1:] == (heads, dk, dv) and state.dtype == torch.float32
    has_beta = beta is not None
    q, k, v, g = (t.float().contiguous() for t in (q, k, v, g))
    beta = beta.float().contiguous() if has_beta else g  # (g: a placeholder the kernels never read)
    out = torch.empty((tokens, heads, dv), dtype=torch.float32, device=q.device)
    if tokens == 0:
        return out
    block_v = max(16, min(VALUE_COLUMNS, triton.next_power_of_2(dv)))
    grid = (len(rows.seq_lens), heads, triton.cdiv(dv, block_v))
    snapshots = rows.snapshots if rows.snapshots is not None else rows.slots
    args = (q, k, v, g, beta, state, out, rows.slots, snapshots, rows.query_start_loc, rows.seq_lens, heads, dk, dv)
    sizes = dict(HAS_BETA=has_beta, HAS_SNAPSHOTS=rows.snapshots is not None,
                 BLOCK_K=max(16, triton.next_power_of_2(dk)), BLOCK_V=block_v)
    _recurrent_kernel[grid](*args, **sizes, num_warps=4)
    if rows.max_query_len > 1:
        _chunked_kernel[grid](*args, **sizes, CHUNK=CHUNK, num_warps=4)
    return out


def gated_delta_rule(
    q: torch.Tensor,  # [T, H, dk] float32, per value head (normalised and scaled by the layer)
    k: torch.Tensor,  # [T, H, dk]
    v: torch.Tensor,  # [T, H, dv]
    g: torch.Tensor,  # [T, H]: log of each row's decay (<= 0)
    beta: torch.Tensor,  # [T, H]
    state: torch.Tensor,  # [state rows, H, dk, dv] float32, contiguous
    rows: StateRows,
) -> torch.Tensor:  # [T, H, dv] float32
    """The gated delta rule over the step's rows, each sequence from its slot's state, the states written back."""
    return _recurrence(q, k, v, g, beta, state, rows)


def ssm_scan(
    q: torch.Tensor,  # [T, H, n] float32 (Mamba2's C, per head)
    k: torch.Tensor,  # [T, H, n] (B)
    v: torch.Tensor,  # [T, H, p] (dt x)
    g: torch.Tensor,  # [T, H]: log of each row's decay (dt A, <= 0)
    state: torch.Tensor,  # [state rows, H, n, p] float32, contiguous
    rows: StateRows,
) -> torch.Tensor:  # [T, H, p] float32
    """Mamba2's selective scan over the step's rows, each sequence from its slot's state, the states written back."""
    return _recurrence(q, k, v, g, None, state, rows)
