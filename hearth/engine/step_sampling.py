"""Draws made inside the backend's decode step (Backend.decode_and_sample): the sampler's math as a
head that the gpu backend records in the step's CUDA graph, after the LM head (the cpu backend runs
it after its pass, sparing a small model's step the building of the Sampler's batch).

What such a head can do is what needs no host work and nothing per request kept on the host:
greedy rows, and random rows with temperature, top-k, top-p and min-p drawn with the global RNG's
noise. The rows' parameters travel as numbers (DecodeSampling.params, kept on the device and
changed by diffs). Anything else (a seeded request's own torch.Generator, logprobs alternatives,
penalties, logit bias, min_tokens, grammar masks, watermarks, contrastive decoding and search,
speculative guesses, forced tokens, LoRA adapters) goes the runner's eager way through the Sampler.

The head is made of the Sampler's own functions (final_distribution, draw, the exponential race),
so a row's token is the eager sampler's given the same noise: with the global RNG seeded alike and
the batch a whole bucket (no padding rows drawing noise), the tokens are the same (on a CPU; a CUDA
graph's RNG replays from its own offsets, so a GPU's random streams differ from eager ones, as
between any two CUDA programs).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from hearth.backend.base import Backend, DecodeSampling
from hearth.engine.sampler import SamplingBatch, draw, final_distribution
from hearth.sampling_params import SamplingParams, SamplingType

# DecodeSampling.params' rows, per request
PARAMS = ("temperature", "greedy", "top_k", "top_p", "min_p")
GREEDY, PLAIN, FILTERED = "greedy", "temperature", "filtered"  # the heads (one graph per bucket each)


def drawn_in_step(params: SamplingParams, num_outputs: int) -> bool:
    """Whether a request's next token can be drawn by the step's head (module docstring);
    num_outputs: the tokens it generated so far (min_tokens bans EOS until there are enough)."""
    return (params.sampling_type != SamplingType.RANDOM_SEED and not params.logprobs and not params.logit_bias
            and num_outputs >= params.min_tokens and not params.reads_earlier_tokens)


def decode_sampling(params: list[SamplingParams], vocab_size: int, backend: Backend) -> DecodeSampling:
    """The step's DecodeSampling: each row's parameters as SamplingBatch.build reads them (a greedy
    row: temperature 1, no filters), and the head the batch needs: (GREEDY, False) when every row
    is greedy, else (PLAIN or FILTERED, whether some rows are greedy) (the greedy rows' one-hot
    [B, V] costs memory and time where no row needs it). A padding row samples at temperature 1."""
    V = vocab_size
    values = np.array([(1.0, 1.0, V, 1.0, 0.0) if p.sampling_type == SamplingType.GREEDY else
                       (p.temperature, 0.0, V if p.top_k <= 0 else min(p.top_k, V), p.top_p, p.min_p)
                       for p in params], dtype=np.float64).T  # [PARAMS, B]
    if values[1].all():
        key = (GREEDY, False)
    elif (values[2] < V).any() or (values[3] < 1.0).any() or (values[4] > 0.0).any():
        key = (FILTERED, bool(values[1].any()))
    else:
        key = (PLAIN, bool(values[1].any()))
    return DecodeSampling(values, (1.0, 0.0, V, 1.0, 0.0), key, functools.partial(_head, *key, backend),
                          all_greedy=key == (GREEDY, False))


def _head(key: str, any_greedy: bool, backend: Backend, logits: torch.Tensor, params: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] float32, params [PARAMS, B] float64 -> (token ids [B] int64, their logprobs
    [B] float32 under the raw distribution), as Sampler.__call__ gives them."""
    raw = logits.float()
    if key == GREEDY:  # the Sampler's argmax_only path
        sampled, lse = backend.argmax_and_logsumexp(raw)
    else:
        noise = torch.empty_like(raw).exponential_()  # exponential_noise's, no row seeded
        filtered = key == FILTERED
        batch = SamplingBatch(
            temperature=params[0].float(), greedy=params[1].bool(), all_greedy=False, any_greedy=any_greedy,
            top_k=params[2].long() if filtered else None, top_p=params[3] if filtered else None,
            min_p=params[4].float() if filtered else None, repetition_penalty=None, presence_penalty=None,
            frequency_penalty=None, prompt_mask=None, output_counts=None, bias=None, banned=None, allowed=None,
            watermark=None, contrastive=None, generators=[], max_num_logprobs=0)
        sampled = draw(*final_distribution(raw, batch), batch, noise)
        lse = raw.logsumexp(dim=-1)
    return sampled, raw.gather(1, sampled.unsqueeze(1)).squeeze(1) - lse
