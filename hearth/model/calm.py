"""CALM (Schuster et al. 2022, "Confident Adaptive Language Modeling"): per-token early exit, lossy by
choice. A decode row of a request with a calm_threshold leaves the model after an exit layer where
its intermediate prediction is confident enough, and takes its token from there.

At each exit layer (after its first N layers, as early exit's draft: speculation/early_exit.py) the
rows that may exit get their intermediate logits: the final norm and LM head on the residual stream
there. Confidence is CALM's softmax response, the top-1 minus the top-2 probability of those logits;
a row whose confidence reaches its threshold exits: its logits are those, and the layers it skips
still get its K/V, which later tokens attend to: CALM's state propagation, each skipped layer's
K and V projected from the exit layer's stream through that layer's input norm
(Transformer.propagate_kv). The other rows run on to the next exit layer, the last one through
every layer. Rows that may not exit (prompts, guesses, requests without a threshold) run every
layer, with the same arithmetic as a step without CALM.

Each exit layer checked costs an LM head pass for its candidate rows (SmolLM2-135M's is as big as 8
of its 30 layers), so CALM checks a few chosen layers (calm_exit_layers), not every one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hearth.backend import StepInputs


def confidence(logits: torch.Tensor) -> torch.Tensor:  # [N, V] -> [N]
    """CALM's softmax response: the top-1 minus the top-2 probability of each row's softmax."""
    top = logits.float().softmax(-1).topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def default_exit_layers(num_layers: int) -> list[int]:
    """Where CALM checks when not told: after half and three quarters of the layers (none in a 1-layer model)."""
    return sorted({n for n in (num_layers // 2, 3 * num_layers // 4) if 1 <= n < num_layers})


@dataclass
class Exited:
    """The rows of a step that left the model early, each one's logits there and its exit layer."""

    rows: list[int]
    logits: torch.Tensor  # [len(rows), vocab]
    layers: list[int]


class CalmExits:
    """A model's pass in segments between its exit layers, rows leaving at each one (`run`)."""

    def __init__(self, model, exit_layers: list[int], kv_caches):
        num_layers = len(model.layers)
        bad = [n for n in exit_layers if not 1 <= n < num_layers]
        if bad or list(exit_layers) != sorted(set(exit_layers)):
            raise ValueError(f"calm_exit_layers must be increasing layer counts in [1, {num_layers - 1}] for this "
                             f"model of {num_layers} layers, got {','.join(map(str, exit_layers))}")
        self.model, self.kv_caches, self.exit_layers = model, kv_caches, list(exit_layers)
        bounds = [0, *exit_layers, num_layers]
        # each segment's view and its caches (kept: the decode path knows its caches by identity)
        self.segments = [(model.layer_range(a, b), kv_caches[a:b]) for a, b in zip(bounds, bounds[1:])]

    @torch.inference_mode()
    def run(self, step: StepInputs, exits: dict[int, float]) -> tuple[torch.Tensor, Exited]:
        """The step's pass: hidden states after the final norm [T, hidden] (an exited row's: at its exit),
        and the rows that exited. exits: the rows that may exit, each
        with its threshold (only where it is its sequence's one new row); the others run every layer."""
        model, backend = self.model, self.model.backend
        thresholds = np.full(len(step.slot_mapping), np.inf)
        thresholds[list(exits)] = list(exits.values())
        input_ids, positions, meta = backend.inputs(model, step)
        x, residual = model.embed(input_ids), None
        out = torch.empty(len(thresholds), model.config.hidden_size, dtype=x.dtype, device=x.device)
        now, seqs = step, np.arange(step.num_seqs)  # the sequences still running: `now`'s are step's seqs
        exited = Exited([], out.new_empty(0, 0), [])
        exited_logits = []
        for index, (view, caches) in enumerate(self.segments):
            x, residual = view.run_layers(x, residual, positions, caches, meta)
            if index == len(self.exit_layers):
                break
            limits = thresholds[step.query_start_loc[seqs]]
            candidates = np.flatnonzero(np.isfinite(limits) & (now.query_lens == 1))  # of seqs
            if not len(candidates):
                continue
            rows = torch.from_numpy(now.query_start_loc[candidates]).long()  # their rows in x
            stream = residual[rows] + x[rows]
            normed = model.norm(stream)
            logits = model.compute_logits(normed)
            exits = (confidence(logits) >= torch.from_numpy(limits[candidates]).to(logits.device)).cpu().numpy()
            if not exits.any():
                continue
            leaving, mask = candidates[exits], torch.from_numpy(exits)
            out[torch.from_numpy(step.query_start_loc[seqs[leaving]]).long()] = normed[mask]
            exited.rows += step.query_start_loc[seqs[leaving]].tolist()
            exited.layers += [self.exit_layers[index]] * len(leaving)
            exited_logits.append(logits[mask])
            model.propagate_kv(self.exit_layers[index], stream[mask], positions[..., rows[mask]], self.kv_caches,
                               meta.slot_mapping[rows[mask]])
            staying = np.setdiff1d(np.arange(len(seqs)), leaving)
            seqs = seqs[staying]
            if not len(seqs):
                break
            kept = torch.from_numpy(now.rows_of(staying))
            x, residual = x[kept], residual[kept]
            now = now.select(staying)
            input_ids, positions, meta = backend.inputs(model, now)
        if len(seqs):
            out[torch.from_numpy(step.rows_of(seqs))] = model.norm(x, residual)[0]
        if exited_logits:
            exited.logits = torch.cat(exited_logits)
        return out, exited

    def logits(self, hidden: torch.Tensor, rows: list[int], exited: Exited) -> torch.Tensor:
        """The logits of the step's rows `rows` [len(rows), vocab]: those of the rows that exited as
        they were computed at their exit, the others' from `hidden` (no second LM head for the first)."""
        where = {row: i for i, row in enumerate(exited.rows)}
        late = [i for i, row in enumerate(rows) if row not in where]
        late_logits = self.model.compute_logits(hidden[torch.tensor([rows[i] for i in late], dtype=torch.long)])
        out = late_logits.new_empty(len(rows), late_logits.shape[1])
        out[torch.tensor(late, dtype=torch.long)] = late_logits
        early = [i for i, row in enumerate(rows) if row in where]
        if early:
            out[torch.tensor(early, dtype=torch.long)] = exited.logits[[where[rows[i]] for i in early]]
        return out

