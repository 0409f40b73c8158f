"""Qwen3.5's and Qwen3-Next's multi-token-prediction (MTP) layers, under their checkpoint names (mtp.*): the
draft of `--speculative-method mtp` (hearth/engine/mtp_draft.py runs it).

A row of the MTP sits at a position p of the sequence and reads two inputs: the embedding of the token
at p + 1 and the hidden state the model gave at p (after its final norm: what its LM head reads, as vLLM's
and llama.cpp's drafts feed it). Each is normed (pre_fc_norm_embedding, pre_fc_norm_hidden), the two are
joined [embedding, hidden] and projected back to the hidden size (fc), one full-attention decoder layer of
the model's own kind runs on that (its K/V in a cache of its own, at the sequence's positions), and a norm
(norm) gives the MTP's hidden state at p, whose logits through the model's LM head guess the token at
p + 2. A later guess feeds that hidden state and the token just guessed at p + 1, and so on.
"""

from __future__ import annotations

import torch
from torch import nn

from hearth.backend.base import Backend
from hearth.config import ModelConfig
from hearth.model.layers import Linear, RMSNorm


class MultiTokenPredictor(nn.Module):
    """mtp.*: fc, pre_fc_norm_embedding, pre_fc_norm_hidden, layers (decoder layers made by the model, full
    attention), norm."""

    def __init__(self, config: ModelConfig, ops: Backend, layers: list[nn.Module]):
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(config.hidden_size, config.rms_norm_eps, ops, config.norm_weight_offset)

        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden = norm(), norm()
        self.fc = Linear(2 * config.hidden_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm()

    def forward(self, embeddings: torch.Tensor, hidden: torch.Tensor, rotaries, kv_cache, meta) -> torch.Tensor:
        """embeddings [T, hidden] of each row's token, hidden [T, hidden] the state each row follows; the first
        layer's K/V in kv_cache (the one layer hearth runs: speculation's config holds mtp_layers to 1).
        Returns the MTP's hidden states [T, hidden], after its norm."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], dim=-1))
        x, residual = self.layers[0](x, None, rotaries, kv_cache, meta)
        return self.norm(x, residual)[0]
