"""A green-list watermark (Kirchenbauer et al., "A Watermark for Large Language Models", 2023).

At every step a keyed hash of the previous token splits the vocabulary: a fraction `gamma`
of the tokens is "green", and their logits get `+delta` before sampling. Text written that
way has far more green tokens than chance; anyone with the key counts them:

    z = (green - gamma * T) / sqrt(T * gamma * (1 - gamma))

over the T scored (previous token, token) pairs, each distinct pair counted once (a phrase
repeated does not count again). Unwatermarked text gives z near 0, with a standard normal
spread; z > 4 happens by chance about three times in 100,000.

Membership is a hash of (key, previous token, token), so the generator and the detector need
the same tokenizer, and nothing else: not the model, not the vocabulary's size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hearth.errors import RequestError
from hearth.sampling_params import WatermarkParams

_MASK32 = 0xFFFFFFFF  # (sampling_params.py checks keys against the same 32 bits)
DETECTION_THRESHOLD = 4.0  # z above this: watermarked


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (Chris Wellons' lowbias32) on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _green(keys: torch.Tensor, prev_ids: torch.Tensor, token_ids: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """Whether token_ids are green after prev_ids; the arguments broadcast (int64, gamma float64)."""
    seed = _hash32((keys & _MASK32) ^ _hash32(prev_ids & _MASK32))
    value = _hash32((seed + token_ids * 0x9E3779B9) & _MASK32)
    return value.double() < gamma * 2.0**32


def green_mask(keys: torch.Tensor, prev_ids: torch.Tensor, gamma: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, V] bool: the green tokens of N rows, each with its key, previous token and gamma [N]."""
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=prev_ids.device)
    return _green(keys.unsqueeze(1), prev_ids.unsqueeze(1), tokens.unsqueeze(0), gamma.unsqueeze(1))


@dataclass
class WatermarkScore:
    z: float
    num_scored: int  # distinct (previous token, token) pairs
    num_green: int
    gamma: float

    @property
    def watermarked(self) -> bool:
        return self.z > DETECTION_THRESHOLD


def detect(token_ids: list[int], key: int, gamma: float = 0.25) -> WatermarkScore:
    """The z-score of a token sequence under `key`; needs at least two tokens."""
    WatermarkParams(key, gamma=gamma)  # the same checks
    pairs = list(dict.fromkeys(zip(token_ids, token_ids[1:])))
    if not pairs:
        raise RequestError("the text is too short to score: it needs at least two tokens")
    prev, tokens = torch.tensor(pairs, dtype=torch.int64).T
    green = int(_green(torch.tensor(key), prev, tokens, torch.tensor(gamma, dtype=torch.float64)).sum())
    T = len(pairs)
    z = (green - gamma * T) / math.sqrt(T * gamma * (1 - gamma))
    return WatermarkScore(z=z, num_scored=T, num_green=green, gamma=gamma)
