"""Perplexity of a model on a text: the quality number quantization is judged by."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hearth.engine.runner import BatchEntry, ModelRunner
from hearth.model.transformer import Transformer


def perplexity(model: Transformer, token_ids: list[int], context: int, device: torch.device) -> dict:
    """Split the tokens into windows of `context` tokens; in each, score every token after the first.

    Returns {"perplexity", "nll" (mean negative log-likelihood, nats), "tokens" (scored)}.
    """
    if context < 2:
        raise ValueError("context must be at least 2 tokens")
    if len(token_ids) < 2:
        raise ValueError(f"the text has {len(token_ids)} token(s); perplexity needs at least 2")
    block_size = 16
    num_blocks = -(-context // block_size)
    runner = ModelRunner(model, num_blocks, block_size, device, model.dtype)
    block_table = list(range(num_blocks))
    total_nll, scored = 0.0, 0
    for start in range(0, len(token_ids) - 1, context):
        window = token_ids[start : start + context]
        if len(window) < 2:
            break
        hidden, _ = runner.execute([BatchEntry(window, 0, block_table)])
        targets = torch.tensor(window[1:], device=device)
        for i in range(0, len(targets), 512):  # logits a slice at a time: vocab x context can be large
            logits = model.compute_logits(hidden[i : min(i + 512, len(targets))])
            total_nll += F.cross_entropy(logits, targets[i : i + 512], reduction="sum").item()
        scored += len(targets)
    nll = total_nll / scored
    return {"perplexity": math.exp(nll), "nll": nll, "tokens": scored}
