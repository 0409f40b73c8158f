"""Perplexity of a model on a text: the quality number quantization is judged by.

The tokens are cut into windows of `context` tokens (the last one may be shorter) and, in each,
every token after the first is scored given the ones before it in its window. Windows run through
the engine's prefill (ModelRunner) several at a time, as sequences of one step, each with its own
KV blocks; the output projection then runs on every scored row of the step in chunks of
`LOGIT_ROWS` (one GEMM each), and the negative log-likelihoods are summed on the device: no Python
per token, no sampling. benchmarks/llamacpp_perplexity.py computes the same on llama.cpp. With a
reference model (`hearth perplexity MODEL --kl-divergence ORIGINAL`) both run on the same windows and
the quantized model's distributions are compared with the original's row by row.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hearth.engine.runner import ModelRunner
from hearth.engine.step_records import BatchEntry
from hearth.kv_format import check_kv_cache_dtype, kv_cache_dtype_name
from hearth.model.transformer import Transformer

BLOCK_SIZE = 16
LOGIT_ROWS = 512  # rows of logits at once: [512, vocab] float32 is 100 MB at a 49k vocabulary


def perplexity(model: Transformer, token_ids: list[int], context: int, device: torch.device,
               max_batch_tokens: int = 2048, kv_cache_dtype: str = "auto", reference: Transformer | None = None) -> dict:
    """Returns {"perplexity", "nll" (mean negative log-likelihood, nats), "tokens" (scored)}; with a
    `reference` model (the original a quantized `model` was made from, same vocabulary) also "kld", the
    mean KL divergence of `model`'s next-token distributions from the reference's over the same rows, and
    "same_top", the share of rows where both rank the same token first (llama-perplexity --kl-divergence).

    max_batch_tokens: windows per forward pass, as many as fit (at least one). kv_cache_dtype: how
    the windows' K/V are stored (hearth/kv_format.py), what a quantized cache costs in quality."""
    if context < 2:
        raise ValueError("context must be at least 2 tokens")
    if len(token_ids) < 2:
        raise ValueError(f"the text has {len(token_ids)} token(s); perplexity needs at least 2")
    if reference is not None and reference.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"the reference model's vocabulary ({reference.config.vocab_size} tokens) is not the "
                         f"model's ({model.config.vocab_size})")
    windows = [token_ids[s:s + context] for s in range(0, len(token_ids) - 1, context)]
    windows = [w for w in windows if len(w) >= 2]
    per_step = max(1, min(len(windows), max_batch_tokens // context))
    blocks_per_window = -(-context // BLOCK_SIZE)
    kv_cache_dtype = kv_cache_dtype_name(kv_cache_dtype)
    models = [model] if reference is None else [model, reference]
    runners = []
    for m in models:
        check_kv_cache_dtype(kv_cache_dtype, m.config, m.backend)
        runners.append(ModelRunner(m, per_step * blocks_per_window, BLOCK_SIZE, device, m.dtype,
                                   kv_cache_dtype=kv_cache_dtype, num_state_slots=per_step))  # (a hybrid's states)
    tables = [list(range(i * blocks_per_window, (i + 1) * blocks_per_window)) for i in range(per_step)]
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # nll, kld, same top token
    for first in range(0, len(windows), per_step):
        step = windows[first:first + per_step]
        entries = [BatchEntry(w, 0, table, state_slot=i) for i, (w, table) in enumerate(zip(step, tables))]
        hiddens = [_scored_rows(*runner.forward(entries)) for runner in runners]
        targets = torch.tensor([t for w in step for t in w[1:]], device=device)
        for i in range(0, len(targets), LOGIT_ROWS):
            logits = model.compute_logits(hiddens[0][i:i + LOGIT_ROWS]).float()
            sums[0] += F.cross_entropy(logits, targets[i:i + LOGIT_ROWS], reduction="sum").double()
            if reference is not None:
                sums[1:] += _divergence(reference.compute_logits(hiddens[1][i:i + LOGIT_ROWS]).float(), logits)
    count = sum(len(w) - 1 for w in windows)
    nll, kld, same_top = (sums / count).tolist()
    result = {"perplexity": math.exp(nll), "nll": nll, "tokens": count}
    return result if reference is None else {**result, "kld": kld, "same_top": same_top}


def _scored_rows(hidden: torch.Tensor, last_rows) -> torch.Tensor:
    """A step's hidden rows but each window's last: each predicts the token after it."""
    scored = torch.ones(len(hidden), dtype=torch.bool, device=hidden.device)
    scored[last_rows] = False
    return hidden[scored]


def _divergence(reference: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """[sum over rows of KL(reference || logits), rows whose top tokens agree], float64."""
    p, q = reference.log_softmax(-1), logits.log_softmax(-1)
    kld = (p.exp() * (p - q)).sum(-1).sum()
    same = (reference.argmax(-1) == logits.argmax(-1)).sum()
    return torch.stack([kld.double(), same.double()])
