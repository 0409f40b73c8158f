"""CALM (Schuster et al. 2022, "Confident Adaptive Language Modeling"): per-token early exit, lossy by
choice. A decode row of a request with a calm_threshold leaves the model after an exit layer where
its intermediate prediction is confident enough, and takes its token from there.

At each exit layer (after its first N layers, as early exit's draft: speculation/early_exit.py) the
rows that may exit get a confidence, by the request's calm_measure (CALM's section 3.5):
- "softmax": the softmax response, the top-1 minus the top-2 probability of the intermediate
  logits (the final norm and LM head on the residual stream there): an LM head pass per check;
- "saturation": hidden-state saturation, the cosine of the residual stream after the exit layer
  and after the layer before it (d^N and d^(N-1)): a few vector ops, no LM head (the step runs
  in segments split before each exit layer too, to see d^(N-1));
- "saturation-softmax": the softmax response, computed only for the rows whose saturation reaches
  the request's calm_saturation_bound (a loose bound that spares most checks their LM head pass).
A row whose confidence reaches its threshold (below 1: 1 never leaves) exits: its logits are those
of its exit layer, and the layers it skips still get its K/V, which later tokens attend to: CALM's
state propagation, each skipped layer's K and V projected from the exit layer's stream through that
layer's input norm (Transformer.propagate_kv). The other rows run on to the next exit layer, the
last one through every layer. Rows that may not exit (prompts, guesses, requests without a
threshold) run every layer, with the same arithmetic as a step without CALM.

A softmax check costs an LM head pass for its candidate rows (SmolLM2-135M's is as big as 8 of its
30 layers), so CALM checks a few chosen layers (calm_exit_layers), not every one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hearth.backend import SaturationChecks, StepInputs
from hearth.sampling_params import CALM_MEASURES

SOFTMAX, SATURATION, SATURATION_SOFTMAX = range(3)  # the measures' codes, CALM_MEASURES' order


@dataclass(frozen=True)
class CalmCheck:
    """A row's exit rule: its request's calm_threshold, calm_measure and calm_saturation_bound."""

    threshold: float
    measure: str = "softmax"
    saturation_bound: float = 0.0


def softmax_response(logits: torch.Tensor) -> torch.Tensor:  # [N, V] -> [N]
    """CALM's softmax response: the top-1 minus the top-2 probability of each row's softmax."""
    top = logits.float().softmax(-1).topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def saturation(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:  # [N, hidden] x 2 -> [N]
    """CALM's hidden-state saturation: the cosine of each row's hidden states after two consecutive layers."""
    return torch.nn.functional.cosine_similarity(before.float(), after.float(), dim=-1)


def default_exit_layers(num_layers: int) -> list[int]:
    """Where CALM checks when not told: after half and three quarters of the layers (none in a 1-layer model)."""
    return sorted({n for n in (num_layers // 2, 3 * num_layers // 4) if 1 <= n < num_layers})


def _stream(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The residual stream from a segment's outputs (the add the next layer's norm would fuse), a
    tensor of its own (the next layer adds to its input stream in place)."""
    return x.clone() if residual is None else residual + x


@dataclass
class Exited:
    """The rows of a step that left the model early, each one's logits there and its exit layer."""

    rows: list[int]
    logits: torch.Tensor  # [len(rows), vocab]
    layers: list[int]


class _Rules:
    """The step's rows' exit rules as arrays over its rows (threshold inf: may not exit)."""

    def __init__(self, num_rows: int, exits: dict[int, CalmCheck]):
        self.thresholds = np.full(num_rows, np.inf)
        self.measures = np.zeros(num_rows, dtype=np.int64)
        self.bounds = np.zeros(num_rows)
        for row, check in exits.items():
            if check.threshold < 1.0:  # 1: never leaves
                self.thresholds[row] = check.threshold
                self.measures[row] = CALM_MEASURES.index(check.measure)
                self.bounds[row] = check.saturation_bound


@dataclass
class _Pass:
    """A CALM step under way: the sequences still running (`now`'s are the step's `seqs`), the rows'
    rules, the final hidden states [T, hidden] filled as rows finish, and the rows that left."""

    step: StepInputs
    now: StepInputs
    seqs: np.ndarray
    rules: _Rules
    out: torch.Tensor
    exited: Exited
    logits: list[torch.Tensor]  # the exited rows', one tensor per exit layer where some left

    def candidates(self) -> tuple[np.ndarray, np.ndarray]:
        """The running sequences that may exit (indices into seqs) and their rows in the step."""
        step_rows = self.step.query_start_loc[self.seqs]
        return np.flatnonzero(np.isfinite(self.rules.thresholds[step_rows]) & (self.now.query_lens == 1)), step_rows

    def cosine_bounds(self) -> torch.Tensor:
        """float32 [rows now]: the cosine at which each row's check may pass (SaturationChecks' thresholds):
        +inf where it may not exit, -inf where it measures the softmax response only."""
        candidates, step_rows = self.candidates()
        rows = step_rows[candidates]
        bounds = np.full(len(self.now.slot_mapping), np.inf, dtype=np.float32)
        measures = self.rules.measures[rows]
        bounds[self.now.query_start_loc[candidates]] = np.where(
            measures == SOFTMAX, -np.inf, np.where(measures == SATURATION, self.rules.thresholds[rows], self.rules.bounds[rows]))
        return torch.from_numpy(bounds)


class CalmExits:
    """A model's pass in segments between its exit layers, rows leaving at each one (`run`)."""

    def __init__(self, model, exit_layers: list[int], kv_caches):
        num_layers = len(model.layers)
        bad = [n for n in exit_layers if not 1 <= n < num_layers]
        if bad or list(exit_layers) != sorted(set(exit_layers)):
            raise ValueError(f"calm_exit_layers must be increasing layer counts in [1, {num_layers - 1}] for this "
                             f"model of {num_layers} layers, got {','.join(map(str, exit_layers))}")
        self.model, self.kv_caches, self.exit_layers = model, kv_caches, list(exit_layers)
        self.views: dict[tuple[int, int], tuple] = {}  # (a, b) -> layers a..b-1's view and caches

    def _view(self, start: int, stop: int) -> tuple:
        """Layers start..stop-1's view of the model and their caches (kept: a view's decode path knows
        its caches by identity)."""
        if (start, stop) not in self.views:
            self.views[start, stop] = (self.model.layer_range(start, stop), self.kv_caches[start:stop])
        return self.views[start, stop]

    def _run(self, start: int, stop: int, x: torch.Tensor, residual: torch.Tensor | None, positions, meta):
        view, caches = self._view(start, stop)
        return view.run_layers(x, residual, positions, caches, meta)

    @torch.inference_mode()
    def run(self, step: StepInputs, exits: dict[int, CalmCheck]) -> tuple[torch.Tensor, Exited]:
        """The step's pass: hidden states after the final norm [T, hidden] (an exited row's: at its exit),
        and the rows that exited. exits: the rows that may exit, each with its rule (only where it is
        its sequence's one new row); the others run every layer."""
        model, backend = self.model, self.model.backend
        rules = _Rules(len(step.slot_mapping), exits)
        input_ids, positions, meta = backend.inputs(model, step)
        x, residual = model.embed(input_ids), None
        out = torch.empty(len(rules.thresholds), model.config.hidden_size, dtype=x.dtype, device=x.device)
        state = _Pass(step, step, np.arange(step.num_seqs), rules, out, Exited([], out.new_empty(0, 0), []), [])
        layer = 0
        while True:
            x, residual, layer, cosines = self._to_check(layer, x, residual, positions, meta, state)
            if layer == len(model.layers):
                break
            staying = self._check(layer, state, x, residual, cosines, positions, meta)
            if staying is not None:
                state.seqs = state.seqs[staying]
                if not len(staying):
                    break
                kept = torch.from_numpy(state.now.rows_of(staying))
                x, residual = x[kept], residual[kept]
                state.now = state.now.select(staying)
                input_ids, positions, meta = backend.inputs(model, state.now)
        if len(state.seqs) == step.num_seqs:  # none left
            return model.norm(x, residual)[0], state.exited
        if len(state.seqs):
            out[torch.from_numpy(step.rows_of(state.seqs))] = model.norm(x, residual)[0]
        if state.logits:
            state.exited.logits = torch.cat(state.logits)
        return out, state.exited

    def _to_check(self, start: int, x: torch.Tensor, residual: torch.Tensor | None, positions, meta, state: _Pass):
        """From layer count `start` on to the next exit layer where some row's check may pass, or to the
        end: (x, residual) there, its layer count, and the rows' saturations there (None: none measured).
        In one call of the backend's decode path where it has one (the kernel measures and stops:
        SaturationChecks); else layer by layer segments, stopping at each exit layer."""
        model, num_layers = self.model, len(self.model.layers)
        later = [n for n in self.exit_layers if n > start]
        bounds = state.cosine_bounds()
        if not later or bool(torch.isposinf(bounds).all()):  # none may exit from here
            return *self._run(start, num_layers, x, residual, positions, meta), num_layers, None
        checks = SaturationChecks(np.array([n - start for n in later], dtype=np.int64), bounds)
        view, caches = self._view(start, num_layers)
        done = model.backend.decode_layers(view, _stream(x, residual), model.rope(positions, x.dtype), caches, meta,
                                           checks)
        if done is not None:
            return *done, start + checks.stop, checks.cosines
        end, before = later[0], None
        if bool(torch.isfinite(bounds).any()):  # a row measures saturation: d^(N-1) for exit layer N
            if end - 1 > start:
                x, residual = self._run(start, end - 1, x, residual, positions, meta)
                start = end - 1
            before = _stream(x, residual)
        x, residual = self._run(start, end, x, residual, positions, meta)
        return x, residual, end, None if before is None else saturation(before, _stream(x, residual))

    def _check(self, layer: int, state: _Pass, x: torch.Tensor, residual: torch.Tensor, cosines: torch.Tensor | None,
               positions: torch.Tensor, meta) -> np.ndarray | None:
        """Exit layer `layer`'s check of the running rows that may exit (x, residual: the pass's outputs
        there; cosines [rows]: their saturations, where some row measures it). The rows that leave get
        their logits, final hidden state and skipped layers' K/V; returns the indices (into state.seqs)
        of the sequences that stay, or None where none leaves."""
        model, rules = self.model, state.rules
        candidates, step_rows = state.candidates()  # (of seqs; each running sequence's first row in the step)
        limits = rules.thresholds[step_rows]
        if not len(candidates):
            return None
        rows = torch.from_numpy(state.now.query_start_loc[candidates]).long()  # their rows in x
        stream = residual[rows] + x[rows]
        measures, bounds = rules.measures[step_rows[candidates]], rules.bounds[step_rows[candidates]]
        confidence = np.full(len(candidates), -np.inf)
        scored = measures == SOFTMAX  # the rows whose softmax response is computed
        if not scored.all():
            saturations = cosines[rows].cpu().numpy()
            confidence[measures == SATURATION] = saturations[measures == SATURATION]
            scored |= (measures == SATURATION_SOFTMAX) & (saturations >= bounds)
        logits = None
        if scored.any():
            logits = model.compute_logits(model.norm(stream[torch.from_numpy(np.flatnonzero(scored))]))
            confidence[scored] = softmax_response(logits).cpu().numpy()
        leave = np.flatnonzero(confidence >= limits[candidates])
        if not len(leave):
            return None
        normed = model.norm(stream[torch.from_numpy(leave)])  # the leaving rows' final hidden states
        state.logits.append(logits[torch.from_numpy(np.cumsum(scored)[leave] - 1)] if scored[leave].all()
                            else model.compute_logits(normed))  # (their logits computed already, or not)
        leaving, mask = candidates[leave], torch.from_numpy(leave)
        state.out[torch.from_numpy(step_rows[leaving]).long()] = normed
        state.exited.rows += step_rows[leaving].tolist()
        state.exited.layers += [layer] * len(leaving)
        model.propagate_kv(layer, stream[mask], positions[..., rows[mask]], self.kv_caches,
                           meta.slot_mapping[rows[mask]])
        return np.setdiff1d(np.arange(len(state.seqs)), leaving)

    def logits(self, hidden: torch.Tensor, rows: list[int], exited: Exited) -> torch.Tensor:
        """The logits of the step's rows `rows` [len(rows), vocab]: those of the rows that exited as
        they were computed at their exit, the others' from `hidden` (no second LM head for the first)."""
        if not exited.rows:
            return self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long)])
        where = {row: i for i, row in enumerate(exited.rows)}
        late = [i for i, row in enumerate(rows) if row not in where]
        late_logits = self.model.compute_logits(hidden[torch.tensor([rows[i] for i in late], dtype=torch.long)])
        out = late_logits.new_empty(len(rows), late_logits.shape[1])
        out[torch.tensor(late, dtype=torch.long)] = late_logits
        early = [i for i, row in enumerate(rows) if row in where]
        if early:
            out[torch.tensor(early, dtype=torch.long)] = exited.logits[[where[rows[i]] for i in early]]
        return out

