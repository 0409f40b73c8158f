"""Speculative decoding, in one package behind one interface (speculator.py's `Speculator`).

A request's next tokens are guessed cheaply and verified by the target in the next step, as
extra tokens of their request (runner + sampler: speculative sampling's rejection rule keeps the
target's distribution; greedy verification keeps plain decoding's tokens).

    speculator.py   the engine's handle: plan (a step's guesses) and update (a step's result),
                    built once from the engine's SpeculativeConfig
    ngram.py        prompt lookup: the continuation of an earlier match of the last tokens
    lookahead.py    lookahead decoding: a Jacobi window and an n-gram pool, in one chain or as published
    lookahead_window.py  as published: the 2-D window and a step's token tree (the window's rows, pool n-grams)
    draft.py        a draft model's guesses: the passes planned here, run by the draft runner
                    (hearth/engine/draft_runner.py, beside the target's runner; the model's own
                    multi-token-prediction layer: hearth/engine/mtp_draft.py)
    early_exit.py   the model's own first layers as the draft (self-speculation), on its KV cache
    token_tree.py   several branches of guesses verified in one pass
    guess_count.py  how many guesses a request makes (its acceptance, the batch)
    speed_gate.py   whether steps with guesses are measured faster than without
    stats.py        the counts of drafts, guesses and accepted guesses (vLLM's names)

Everything here is host bookkeeping (no tensors): the draft's passes and distributions are the
draft runner's, and the verification is the target's runner's and sampler's.
"""
