"""AWQ's activation-aware scale search (Lin et al., 2023) for `hearth quantize --awq`.

A projection's output W x equals (W diag(s)) (x / s) for any positive per-input-column scale s.
Quantizing W diag(s) instead of W keeps the columns that meet large activations more precisely (a
block's scale is shared, its rounding error is not): AWQ picks, for each group of projections that
read one input, s = mean|x|^alpha (normalized so that max(s) * min(s) = 1) with alpha on a grid of
GRID values in [0, 1), the one whose quantized output (X / s) Q(W diag(s))^T is nearest to X W^T
in mean squared error on calibration activations X; alpha = 0 (s = 1, plain quantization) is on
the grid, so the calibration error never grows. The 1 / s goes into what computes the input: the
RMSNorm's weight before q/k/v and before gate/up, up's rows before down, v's rows before o (only
where each o column reads one v row: no grouped-query attention, as AutoAWQ does).

Everything works on the GGUF tensors `hearth quantize` writes (hearth/loading/quantize.py's plan,
each quantized in its own type of the mix, by the same encoder that writes the file); the
activations come from the engine's own prefill over the calibration text, through the forward
pre-hooks hearth/imatrix.py puts on the projections. With an importance matrix, each weighted
column's importance is divided by s^2 (its input is x / s).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from hearth.errors import HearthError
from hearth.imatrix import hooked_projections, run_windows
from hearth.loading.convert import PlannedTensor, encode_tensor, write_gguf
from hearth.loading.quantize import plan_quantization
from hearth.model.layers import GatedMLP
from hearth.model.transformer import Transformer
from hearth.quant import dequantize

GRID = 20
# a group's first weight -> what computes its input: a norm's weight, or a weight's rows
_INPUT_OF = {"attn_q": "attn_norm", "ffn_gate": "ffn_norm", "ffn_up": "ffn_norm", "ffn_down": "ffn_up",
             "attn_output": "attn_v"}


def calibration_inputs(model: Transformer, token_ids: list[int], context: int, device: torch.device,
                       bos_token_id: int | None = None, max_rows: int = 4096) -> list[tuple[list[str], torch.Tensor]]:
    """(GGUF names of the weights that read an input, that input's rows X [n <= max_rows, cols], float32
    on the CPU) for every projection input in the layers, over the chunks of `context` tokens."""
    chunks = [list(token_ids[s:s + context]) for s in range(0, len(token_ids) - context + 1, context)]
    if not chunks:
        raise HearthError(f"the calibration text has {len(token_ids)} tokens, fewer than one chunk of {context}")
    for chunk in chunks if bos_token_id is not None else ():
        chunk[0] = bos_token_id
    projections = hooked_projections(model)
    seen: list[list[torch.Tensor]] = [[] for _ in projections]
    stride = -(-len(chunks) * context // max_rows)  # every stride-th token's row kept: about max_rows in all
    hooks = [module.register_forward_pre_hook(lambda _, args, rows=rows: rows.append(
        args[0].reshape(-1, args[0].shape[-1])[::stride].float().cpu())) for (module, _), rows in zip(projections, seen)]
    try:
        run_windows(model, chunks, device, max_batch_tokens=2048)
    finally:
        for hook in hooks:
            hook.remove()
    return [(names, torch.cat(rows)) for (_, names), rows in zip(projections, seen)]


def roundtrip(values: torch.Tensor, qtype, importance: np.ndarray | None) -> torch.Tensor:
    """`values` as the file will hold them: encoded in `qtype` as quantize writes it, read back."""
    encoded = np.ascontiguousarray(encode_tensor(values, qtype, importance))
    return dequantize(torch.from_numpy(encoded.view(np.uint8).reshape(-1)), qtype, tuple(values.shape))


def search_scale(x: torch.Tensor, weights: list[tuple[torch.Tensor, object, np.ndarray | None]],
                 output: Callable[[list[torch.Tensor]], torch.Tensor] | None = None) -> torch.Tensor:
    """The column scale s [cols] of the grid's alpha that quantizes `weights` ((W [rows, cols], its type,
    its importance or None), all reading x [n, cols]) with the least mean squared error on x of
    output(the projections' outputs) (None: the outputs side by side)."""
    output = output or (lambda outs: torch.cat(outs, dim=-1))
    mean = x.abs().mean(0).clamp(min=1e-8)
    reference = output([x @ w.T for w, _, _ in weights])
    best, best_error = torch.ones_like(mean), float("inf")
    for step in range(GRID):
        s = mean.pow(step / GRID)
        s = s / (s.max() * s.min()).sqrt()
        quantized = [roundtrip(w * s, qtype, None if importance is None else importance / (s * s).numpy())
                     for w, qtype, importance in weights]
        error = float((output([(x / s) @ q.T for q in quantized]) - reference).pow(2).mean())
        if error < best_error:
            best, best_error = s, error
    return best


def awq_scales(plan: list[PlannedTensor], inputs: list[tuple[list[str], torch.Tensor]],
               imatrix: dict[str, np.ndarray] | None, act_and_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               on_group: Callable[[], None] | None = None) -> dict[str, torch.Tensor]:
    """The scale s of each input whose group of weights can take it (by the group's first weight's name).
    Gate and up are judged by the MLP's output (down(act(gate) * up), down as it is), as AutoAWQ does;
    the other groups by their own outputs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small products, hundreds of them: waking a thread pool costs more than it saves
    try:
        return _search_groups(plan, inputs, imatrix, act_and_mul, on_group)
    finally:
        torch.set_num_threads(threads)


def _search_groups(plan: list[PlannedTensor], inputs: list[tuple[list[str], torch.Tensor]],
                   imatrix: dict[str, np.ndarray] | None, act_and_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   on_group: Callable[[], None] | None) -> dict[str, torch.Tensor]:
    by_name = {name: (shape, qtype, values) for name, shape, qtype, values in plan}
    scales = {}
    for names, x in inputs:
        first = names[0]
        kind = first.split(".")[-2]
        source = first.replace(kind, _INPUT_OF.get(kind, "?"))
        if source not in by_name or (kind == "attn_output" and by_name[source][0][0] != x.shape[1]):
            continue  # no norm or weight rows to fold 1 / s into (o_proj under grouped-query attention)
        if all(by_name[n][1] in (Q.F32, Q.F16) for n in names):
            continue  # not rounded to a block format: nothing to gain
        weights = [(by_name[n][2](), by_name[n][1], (imatrix or {}).get(n)) for n in names]
        output = None
        if kind == "ffn_gate" and len(names) == 2:
            down = by_name[first.replace(kind, "ffn_down")][2]()
            output = lambda outs, down=down: act_and_mul(*outs) @ down.T  # noqa: E731
        scales[first] = search_scale(x, weights, output)
        if on_group is not None:
            on_group()
    return scales


def folded(plan: list[PlannedTensor], groups: list[list[str]], scales: dict[str, torch.Tensor]
           ) -> list[PlannedTensor]:
    """The plan with each group's columns times its s and 1 / s folded into its input's source."""
    columns: dict[str, torch.Tensor] = {}
    rows: dict[str, torch.Tensor] = {}
    for names in groups:
        if names[0] not in scales:
            continue
        s = scales[names[0]]
        columns.update((name, s) for name in names)
        kind = names[0].split(".")[-2]
        source = names[0].replace(kind, _INPUT_OF[kind])
        rows[source] = rows[source.removesuffix(".weight") + ".bias"] = 1 / s  # (a norm's weight: one row)

    def rescaled(name: str, values: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def scaled() -> torch.Tensor:
            t = values()
            if name in columns:
                t = t * columns[name]
            if name in rows:  # a weight's rows, a bias's values, a norm's weight
                t = t * (rows[name] if t.dim() == 1 else rows[name][:, None])
            return t

        return scaled

    return [(name, shape, qtype, rescaled(name, values)) for name, shape, qtype, values in plan]


def awq_quantize_model(model: Transformer, source: str | Path, out_path: str | Path, mix: str,
                       token_ids: list[int], context: int, device: torch.device, bos_token_id: int | None = None,
                       imatrix: dict[str, np.ndarray] | None = None, progress: bool = True) -> Path:
    """`hearth quantize --awq`: `source` (`model` loaded from it) quantized to `mix` at `out_path`
    (returned), with AWQ's scales searched on the chunks of `token_ids`."""
    from tqdm import tqdm

    if model.config.num_experts:
        raise HearthError("AWQ: hearth searches the scales of dense models; this one has experts")
    inputs = calibration_inputs(model, token_ids, context, device, bos_token_id)
    writer, plan = plan_quantization(source, mix, imatrix, progress)
    with tqdm(total=len(inputs), desc="AWQ scales", unit="input", disable=not progress, leave=False) as bar:
        mlp = next(m for m in model.modules() if isinstance(m, GatedMLP))
        scales = awq_scales(plan, inputs, imatrix, lambda g, u: model.backend.act_and_mul(g, u, mlp.activation),
                            bar.update)
    groups = [names for names, _ in inputs]
    if imatrix is not None:  # the inputs of scaled columns are x / s
        imatrix = dict(imatrix)
        for names in (names for names in groups if names[0] in scales):
            imatrix.update((n, imatrix[n] / (scales[names[0]] ** 2).numpy()) for n in names if n in imatrix)
    return write_gguf(writer, folded(plan, groups, scales), out_path, f"quantizing to {mix} with AWQ", progress,
                      importance=imatrix)


def awq_quantize(source: Path, out_path: Path, mix: str, text_file: Path, context: int = 512,
                 imatrix: dict[str, np.ndarray] | None = None) -> Path:
    """`hearth quantize --awq TEXT_FILE`: `source` loaded (float32, on the CPU) to run the calibration text."""
    from hearth.loading.loader import load_model

    try:
        text = text_file.read_text(encoding="utf-8")
    except OSError as e:
        raise HearthError(f"{text_file}: cannot read: {e.strerror}") from None
    device = torch.device("cpu")
    loaded = load_model(source, torch.float32, device)
    tok = loaded.tokenizer
    return awq_quantize_model(loaded.model, source, out_path, mix, tok.encode(text, add_special_tokens=False), context,
                              device, tok.bos_token_id if tok.add_bos else None, imatrix)
