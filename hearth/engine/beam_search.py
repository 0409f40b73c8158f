"""Beam search through the paged engine: every beam is a one-token request on its own tokens.

Beams of one prompt share their prefix blocks through the prefix cache, so a step
recomputes at most the last, partly filled block of each beam. Selection follows
transformers' `generate(num_beams=...)` (early_stopping=False): each step keeps the
`beam_width` best running continuations and finalizes, among the `beam_width` best
candidates, those that end in EOS or reach max_tokens, scored by
cumulative logprob / generated_length ** length_penalty.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hearth.sampling_params import BeamSearchParams, SamplingParams

NEG_INF = -1.0e9


@dataclass
class BeamSearchSequence:
    token_ids: list[int]  # generated tokens (EOS included when it ended the beam)
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    text: str = ""
    finish_reason: str = "length"  # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]  # best first


@dataclass
class _PromptState:
    prompt: list[int]
    running: list[tuple[list[int], float]]  # (generated tokens, cumulative logprob)
    finished: list[BeamSearchSequence] = field(default_factory=list)
    improvable: bool = True  # transformers' early-stop heuristic not yet satisfied
    done: bool = False


def beam_search(engine, prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    width, penalty = params.beam_width, params.length_penalty
    eos = set() if params.ignore_eos else set(engine.tokenizer.eos_token_ids)
    keep = max(2, 1 + len(eos)) * width  # candidates looked at per step
    step_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=keep, ignore_eos=True)
    states = [_PromptState(list(p), [([], 0.0)]) for p in prompts]
    for step in range(params.max_tokens):
        last_step = step + 1 == params.max_tokens
        live = [s for s in states if not s.done]
        if not live:
            break
        # one request per running beam of every live prompt; their outputs carry top-`keep` logprobs
        ids = {}
        for si, state in enumerate(live):
            for bi, (tokens, _) in enumerate(state.running):
                ids[engine.add_request(None, state.prompt + tokens, step_params)] = (si, bi)
        alternatives: dict[tuple[int, int], dict[int, float]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id in ids:
                    alternatives[ids[out.request_id]] = out.outputs[0].logprobs[0]
        for si, state in enumerate(live):
            candidates = []  # (cumulative logprob, tokens)
            for bi, (tokens, cum) in enumerate(state.running):
                for token, logprob in alternatives[(si, bi)].items():
                    candidates.append((cum + logprob, tokens + [token]))
            candidates.sort(key=lambda c: c[0], reverse=True)
            candidates = candidates[:keep]
            ends = [last_step or c[1][-1] in eos for c in candidates]
            state.running = [(c[1], c[0]) for c, end in zip(candidates, ends) if not end][:width]
            if state.improvable:
                for rank, (c, end) in enumerate(zip(candidates[:width], ends)):
                    if end:
                        state.finished.append(BeamSearchSequence(
                            c[1], c[0], c[0] / len(c[1]) ** penalty,
                            finish_reason="stop" if c[1][-1] in eos else "length",
                        ))
                state.finished.sort(key=lambda s: s.score, reverse=True)
                del state.finished[width:]
            generated = step + 1
            if state.running and len(state.finished) == width:
                best_possible = state.running[0][1] / generated**penalty
                state.improvable = best_possible > state.finished[-1].score
            state.done = not state.improvable or not state.running or last_step
    outputs = []
    for state in states:
        for seq in state.finished:
            seq.text = engine.tokenizer.decode([t for t in seq.token_ids if t not in eos])
        outputs.append(BeamSearchOutput(state.prompt, state.finished))
    return outputs
