"""Calibration of activation sparsity's thresholds (`hearth sparsify`; docs/sparsity.md).

A calibration text runs through the dense model's own prefill (ModelRunner, as perplexity.py and
imatrix.py), in windows of `context` tokens; forward pre-hooks on the projections that read each
site (hearth/model/activation_sparsity.py) count the magnitudes |x| of its every activation into a
histogram of BINS bins even in log2 |x| from 2^LOG2_LOW to 2^LOG2_HIGH (0.7% apart: a quantile is
found to that precision; smaller magnitudes, zeros included, fall into the first bin). The
threshold for a sparsity s is the magnitude under which a share s of the counts lies, interpolated
in log2 inside its bin: TEAL's uniform per-tensor rule, one threshold per input and layer.
"""

from __future__ import annotations

import torch

from hearth.errors import HearthError
from hearth.imatrix import run_windows
from hearth.loading.activation_thresholds import GRID, ActivationThresholds, model_shape
from hearth.model.activation_sparsity import site_modules
from hearth.model.transformer import Transformer

BINS, LOG2_LOW, LOG2_HIGH = 8192, -40.0, 20.0


def magnitude_histogram(x: torch.Tensor) -> torch.Tensor:
    """int64 [BINS]: how many entries of x have log2 |x| in each bin (see the module's docstring)."""
    scaled = (x.detach().float().abs().log2() - LOG2_LOW) * (BINS / (LOG2_HIGH - LOG2_LOW))
    bins = scaled.nan_to_num(0.0, 0.0, 0.0).clamp_(0, BINS - 1).long()  # zeros: -inf -> the first bin
    return torch.bincount(bins.reshape(-1), minlength=BINS)


def quantiles(histogram: torch.Tensor, shares: tuple[float, ...]) -> list[float]:
    """The magnitude under which each share of the histogram's counts lies (share 1: the top of the
    highest bin counted; share 0: 0)."""
    counts = histogram.double()
    cumulative = counts.cumsum(0)
    total, width = cumulative[-1].item(), (LOG2_HIGH - LOG2_LOW) / BINS
    out = []
    for share in shares:
        if share <= 0:
            out.append(0.0)
            continue
        target = share * total
        b = int(torch.searchsorted(cumulative, torch.tensor([target], dtype=torch.float64)).clamp(max=BINS - 1))
        below = cumulative[b - 1].item() if b else 0.0
        inside = (target - below) / counts[b].item() if counts[b] else 1.0
        out.append(float(2.0 ** (LOG2_LOW + (b + inside) * width)))
    return out


def calibrate(model: Transformer, token_ids: list[int], context: int, device: torch.device, source: str,
              max_batch_tokens: int = 2048) -> ActivationThresholds:
    """The thresholds of every site of `model` (dense) at every GRID sparsity, from `token_ids`."""
    windows = [token_ids[s:s + context] for s in range(0, len(token_ids), context)]
    windows = [w for w in windows if len(w) >= 2]
    if not windows:
        raise HearthError(f"the calibration text has {len(token_ids)} token(s): too few")
    sites = site_modules(model)
    histograms: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for key, module in sites.items():
        def count(_, args, key=key):
            found = magnitude_histogram(args[0])
            histograms[key] = histograms[key] + found if key in histograms else found

        hooks.append(module.register_forward_pre_hook(count))
    try:
        run_windows(model, windows, device, max_batch_tokens)
    finally:
        for hook in hooks:
            hook.remove()
    thresholds = {f"{layer}.{site}": quantiles(histograms[(layer, site)].cpu(), GRID) for layer, site in sites}
    return ActivationThresholds(model_shape(model.config), source, sum(map(len, windows)), thresholds)

