"""Whether guesses pay on this machine, measured: the speed gate. No tensors.

The guess count (guess_count.py) is a model; `SpeedGate` holds the measurement: decode steps'
output tokens per second per request, with guesses and without. While steps with guesses are
measured slower (a backend whose multi-token steps leave its decode fast path, a machine whose
cores are taken), no guesses are made, except a few steps in every PROBE_EVERY that keep measuring them.
"""

from __future__ import annotations

from hearth.engine.speculation.guess_count import RATE_MEMORY

# The option (guesses or none) that measured slower is tried PROBE_STEPS steps in a row, to keep
# measuring it (SpeedGate): PROBE_EVERY steps after the last probe, twice as long after each probe
# that left the preference as it was, up to PROBE_EVERY_MAX steps (a probe is paid at the slower
# option's speed: at a fixed 4 steps in 16, a quarter of prompt lookup's steps at batch 1 ran without guesses).
PROBE_EVERY = 16
PROBE_EVERY_MAX = 128
PROBE_STEPS = 4


class SpeedGate:
    """Whether the next step may carry guesses: only while steps with them are not measured slower.

    The option measured slower is probed PROBE_STEPS steps in a row, PROBE_EVERY steps after the last
    probe, the interval doubling (up to PROBE_EVERY_MAX) while probes confirm the preference and
    back to PROBE_EVERY when one turns it. The first step after a switch is not measured: it pays
    for the switch (a draft model catching up with the tokens decoded without it, a lookahead
    window grown again), not for the option, and one such step counted against guessing would keep
    it off for good."""

    def __init__(self) -> None:
        # with guesses? -> recent (tokens per request, seconds), each a moving sum: a step that kept
        # 5 tokens and one that kept 1 weigh by their tokens and seconds, not as two speeds averaged
        self._recent: dict[bool, tuple[float, float] | None] = {True: None, False: None}
        self._last: bool | None = None  # the option of the step recorded last
        self._interval = PROBE_EVERY  # steps from the end of one probe to the start of the next
        self._to_probe = PROBE_EVERY  # steps left before the next probe
        self._probing: bool | None = None  # during a probe: the preference it started from
        self._probe_left = 0

    @property
    def speed(self) -> dict[bool, float | None]:
        """With guesses? -> recent output tokens per second per request (None: not measured)."""
        return {option: None if recent is None else recent[0] / recent[1] for option, recent in self._recent.items()}

    def record(self, with_guesses: bool, num_tokens: int, num_requests: int, seconds: float) -> None:
        """A step made only of decodes (and verifications): its output tokens and duration."""
        switched, self._last = with_guesses != self._last, with_guesses
        if switched or seconds <= 0 or num_requests <= 0:
            return
        tokens, old = num_tokens / num_requests, self._recent[with_guesses]
        self._recent[with_guesses] = (tokens, seconds) if old is None else (
            RATE_MEMORY * old[0] + tokens, RATE_MEMORY * old[1] + seconds)

    def allow(self) -> bool:
        with_guesses, without = self.speed[True], self.speed[False]
        preferred = with_guesses is None or without is None or with_guesses >= without
        if without is None and with_guesses is not None:
            preferred = False  # measure plain steps once
        if self._probing is None and self._to_probe > 0:
            self._to_probe -= 1
            return preferred
        if self._probing is None:  # a probe starts
            self._probing, self._probe_left = preferred, PROBE_STEPS
        if self._probe_left:
            self._probe_left -= 1
            return not self._probing
        # the probe is over: probe again later while it confirmed the preference, soon if it turned it
        self._interval = min(2 * self._interval, PROBE_EVERY_MAX) if preferred == self._probing else PROBE_EVERY
        self._to_probe, self._probing = self._interval, None
        return self.allow()
