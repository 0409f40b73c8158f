"""Contrastive search's choice of a token (Su et al. 2022, "A Contrastive Framework for Neural Text
Generation"; transformers' `penalty_alpha`), on tensors the runner built.

At each step the k likeliest tokens v (top_k, by the softmax of the logits after penalties and bias,
no temperature) are candidates; each one's hidden state h_v is that of the model's last layer after
the final norm (transformers' `hidden_states[-1]`) at the next position, and the token chosen is

    argmax_v  (1 - alpha) p(v) - alpha max_j cos(h_v, h_j)

over the hidden states h_j of every token before it, prompt included (the degeneration penalty);
ties go to the likelier candidate (the first of top-k's order), as transformers' `_ranking_fast`.
The runner (runner.py) keeps each request's hidden states, runs the candidates as one extra pass
of k rows per request (a token tree of siblings after its last token, in scratch slots the scheduler
gives it) and calls these two functions.
"""

from __future__ import annotations

import torch


def candidates(penalised: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k likeliest tokens of one row's logits after penalties [V]: (probabilities [k], ids [k]), likeliest first."""
    return penalised.float().softmax(dim=-1).topk(k)


def choose(context: torch.Tensor, hidden: torch.Tensor, probs: torch.Tensor, alpha: float) -> torch.Tensor:
    """The index (0-d) of the chosen candidate: context [t, H] the hidden states of the tokens so far,
    hidden [k, H] the candidates', probs [k] their probabilities."""
    cosine = torch.nn.functional.normalize(hidden.float(), dim=-1) @ torch.nn.functional.normalize(
        context.float(), dim=-1).T  # [k, t]
    penalty = cosine.max(dim=-1).values
    return ((1.0 - alpha) * probs - alpha * penalty).argmax()  # the first of equal maxima
