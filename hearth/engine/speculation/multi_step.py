"""Multi-step decoding (`speculative_method="multi-step"`): k + 1 tokens of a greedy request a step,
each the model's own. Host lists only, no tensors.

On a CPU a small model's decode step is a few milliseconds of kernel and ~0.6 ms of the host's
work between kernels (scheduling, laying out, output processing: Python with its caches cold
after the weights streamed through them). vLLM's multi-step scheduling ran several decode steps
per schedule for that cost on a GPU; here the cpu backend's greedy kernel already chains passes
(a draft model's guesses, draft_runner.py), so a step of the target can run k + 1 of them in one
call. The speculation machinery carries it: the proposer gives each request it can chain k
placeholder guesses (its last token: verified as guesses only where a step cannot chain, say with
a prompt chunk in it), the scheduler allots their slots, the runner's
chained passes (engine/chain_passes.py) fill them with the model's argmax after each, all kept,
and the output processing keeps the tokens up to a stop (an EOS, a stop string, max_tokens),
giving the slots after it back. The tokens are plain greedy decoding's; what a stop costs is the
passes after it in its step. A step whose requests the kernel cannot all chain (sampled, seeded,
logprobs, penalties, grammars) gets no guesses, and the speed gate (adaptive) stops the guessing
where the chained steps measure slower.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hearth.engine.request import Request


class MultiStepProposer:
    """Placeholder guesses for the requests the target's chained passes can decode."""

    def __init__(self, chains: Callable[[Request], bool]):
        """chains: whether the runner's chained passes can decode a request (chain_passes.can_chain)."""
        self.chains = chains

    def guess(self, wanted: dict[Request, int], generators: dict[Request, torch.Generator | None],
              verified_rows: dict[Request, list[int]]) -> None:
        """k placeholders for each request of `wanted`, where the passes can chain every one of them (a step
        runs its passes for all its requests or for none; generators and verified_rows: other proposers')."""
        if all(map(self.chains, wanted)):
            for request, k in wanted.items():
                request.set_guesses([request.all_token_ids[-1]] * k)
