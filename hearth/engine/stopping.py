"""When a request stops: by token (EOS, stop_token_ids, max_tokens) and by stop string.

Pure Python, one request at a time; the engine calls these after appending a token.

Token stops (`check_token_stop`), checked in vLLM's order on the token just generated:
  1. fewer than `min_tokens` outputs (this token counted): never stop (the sampler has
     masked EOS and stop_token_ids, so they cannot occur here anyway);
  2. an EOS id, unless `ignore_eos` -> "stop";
  3. one of `stop_token_ids` -> "stop";
  4. `max_tokens` outputs reached -> "length".
  The stopping token id stays in the output's token_ids, but its text is never added to
  the output text (so EOS and stop tokens never show in `text`). A request with
  max_tokens=0 generates nothing and finishes with "length" without calling this.

Stop strings (`find_stop_string`): a stop string may span token boundaries, so each
new piece is searched together with the last len(stop) - 1 characters before it. The
match that completes first (the earliest end; at equal ends the earlier start) wins,
which is what a character-by-character stream would have hit. The output text is cut
before the stop string, or after it with include_stop_str_in_output; finish reason "stop".

Streaming (`stream_safe_length`): text that may still turn out to be the beginning of a
stop string is held back until it either completes a stop string or cannot any more.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from hearth.sampling_params import SamplingParams


def check_token_stop(
    token_id: int, num_output_tokens: int, params: SamplingParams, eos_token_ids: Collection[int]
) -> str | None:
    """Finish reason after appending `token_id` as output token number `num_output_tokens`
    (counting it): "stop" (EOS / a stop token id), "length" (max_tokens reached) or None."""
    if num_output_tokens < params.min_tokens:
        return None
    if not params.ignore_eos and token_id in eos_token_ids:
        return "stop"
    if token_id in params.stop_token_ids:
        return "stop"
    if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
        return "length"
    return None


def find_stop_string(
    text: str, prev_len: int, stop: Sequence[str], include_stop_str_in_output: bool = False
) -> tuple[str, str] | None:
    """Search `text` for a stop string that ends after its first `prev_len` characters.

    `text` is the whole output text including this step's new piece; `text[:prev_len]` is
    the text before this step, already checked (no stop string ends inside it). Returns
    (text cut at the match, the matched stop string) or None.
    """
    if not stop or len(text) <= prev_len:
        return None
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    for s in stop:
        start = text.find(s, max(0, prev_len - len(s) + 1))
        if start < 0:
            continue
        candidate = (start + len(s), start, s)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    if best is None:
        return None
    end, start, s = best
    return (text[:end] if include_stop_str_in_output else text[:start]), s


def stream_safe_length(text: str, stop_strings: Sequence[str], include_stop_str_in_output: bool = False) -> int:
    """How many leading characters of `text` (in which no stop string has matched) can be
    streamed now and never taken back.

    The held-back tail is the longest suffix of `text` that is a proper prefix of a stop
    string, at most max(len(stop)) - 1 characters (vLLM holds back exactly that many; this
    holds back only what could still grow into a stop string). With
    include_stop_str_in_output nothing is held back: the stop string is output either way.
    """
    if include_stop_str_in_output or not stop_strings:
        return len(text)
    held = 0
    for s in stop_strings:
        for n in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:n]):
                held = n
                break
    return len(text) - held
