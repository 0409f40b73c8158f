"""Where speculative guesses come from and how many (hearth/engine/speculation/): prompt lookup's
guesses and branches against brute-force searches, lookahead's guesses reaching the greedy text, the
guess count against a direct search over counts, and the speed gate's probes."""

from __future__ import annotations

import random
import re

import pytest

from hearth.engine.request import Request
from hearth.engine.speculation.guess_count import PRIOR_RATE, ROW_COST, AcceptanceRate, num_guesses
from hearth.engine.speculation.lookahead import LookaheadProposer
from hearth.engine.speculation.lookahead_window import JacobiWindow, lookahead_tree
from hearth.engine.speculation.ngram import NgramProposer
from hearth.engine.speculation.speed_gate import PROBE_EVERY, PROBE_EVERY_MAX, PROBE_STEPS, SpeedGate
from hearth.engine.speculation.token_tree import accepted_path, ancestor_masks, tree_of


def brute_force_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest n (max_n .. min_n) whose last-n-token suffix occurs earlier; of those the latest
    occurrence; its next k tokens, the text read on periodically past the end."""
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):
            if start >= 0 and len(suffix) == n and tokens[start : start + n] == suffix:
                text = list(tokens)
                pos = start + n
                while len(text) < len(tokens) + k:
                    text.append(text[pos])
                    pos += 1
                return text[len(tokens) :]
    return []


def test_ngram_proposer_matches_a_brute_force_search():
    rng = random.Random(0)
    for _ in range(500):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        k, min_n = rng.randint(1, 6), rng.randint(1, 3)
        max_n = min_n + rng.randint(0, 3)
        assert NgramProposer(min_n, max_n).lookup(tokens, k) == brute_force_lookup(tokens, k, min_n, max_n), tokens
    assert NgramProposer(1, 3).lookup([1, 2, 3, 1, 2], 4) == [3, 1, 2, 3]
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


def brute_force_branches(tokens: list[int], k: int, min_n: int, max_n: int, width: int) -> list[list[int]]:
    """Every earlier position whose last n >= min_n tokens equal the text's last n, ranked by its
    longest such n (up to max_n), then the latest; their next k tokens (read on periodically past
    the end), the first `width` different ones."""
    ranked = []
    for end in range(len(tokens) - 1):
        n = 0
        while n < min(max_n, end + 1) and tokens[end - n] == tokens[len(tokens) - 1 - n]:
            n += 1
        if n >= min_n:
            ranked.append((n, end))
    branches = []
    for _, end in sorted(ranked, reverse=True):
        text = list(tokens)
        while len(text) < len(tokens) + k:
            text.append(text[end + 1 + len(text) - len(tokens)])
        if text[len(tokens) :] not in branches:
            branches.append(text[len(tokens) :])
    return branches[:width]


def test_ngram_branches_and_their_tree():
    """Several matches' continuations against a brute-force search; the tree that holds them: each
    branch read back from its last node through the parents, siblings all different, as many
    nodes as different prefixes, each row's mask its ancestors and itself, and the path of the
    accepted guesses."""
    rng = random.Random(1)
    for _ in range(300):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        k, min_n, width = rng.randint(1, 5), rng.randint(1, 3), rng.randint(1, 4)
        max_n = min_n + rng.randint(0, 3)
        branches = NgramProposer(min_n, max_n).branches(tokens, k, width)
        assert branches == brute_force_branches(tokens, k, min_n, max_n, width), tokens
        guesses, parents = tree_of(branches)
        assert len(guesses) == len({tuple(b[:i]) for b in branches for i in range(1, len(b) + 1)})
        siblings = [(parent, token) for parent, token in zip(parents, guesses)]
        assert len(siblings) == len(set(siblings)) and all(p < i for i, p in enumerate(parents))
        masks = ancestor_masks(parents)
        for branch in branches:
            node = next(i for i in range(len(guesses)) if _branch_of(guesses, parents, i) == branch)
            ancestors = {0} | {1 + i for i in range(len(guesses)) if branch[: len(_branch_of(guesses, parents, i))]
                                == _branch_of(guesses, parents, i)}
            assert masks[1 + node] == sum(1 << row for row in ancestors)
        if branches:  # accepting the guesses of the last branch: its path, whatever else is accepted
            last = branches[-1]
            on_path = [_branch_of(guesses, parents, i) == last[: len(_branch_of(guesses, parents, i))]
                       for i in range(len(guesses))]
            assert [guesses[i] for i in accepted_path(parents, on_path)] == last


def _branch_of(guesses: list[int], parents: list[int], node: int) -> list[int]:
    """The guesses from the root to `node`, read through the parents."""
    path = []
    while node >= 0:
        path.insert(0, guesses[node])
        node = parents[node]
    return path


def greedy_rule(context: list[int]) -> int:
    """A stand-in model's greedy choice: each token a fixed random function of the two before it,
    over 10 tokens (the text falls into loops, as small models' greedy text does)."""
    return random.Random(context[-2] * 10 + context[-1]).randrange(10)


def test_lookahead_guesses_converge_and_keep_the_greedy_text():
    """Verification simulated with the rule as the model: each step's rows give the rule's token
    after the text and after each guess; the guesses up to the first wrong one are kept, then one
    more token. Jacobi iterations and the pool make 200 tokens take far fewer steps than 200 (at
    most 5 tokens a step: at least 40; 60 as written)."""
    expected = [1, 2]
    while len(expected) < 202:
        expected.append(greedy_rule(expected))
    request = Request("r", expected[:2])
    proposer = LookaheadProposer()
    row_tokens = [greedy_rule(request.all_token_ids)]  # the prompt's step: one row
    request.append_output_token(row_tokens[0])
    steps = 1
    while request.num_tokens < len(expected):
        guesses = proposer.propose(request, 4, row_tokens)
        assert len(guesses) == 4
        context = list(request.all_token_ids)
        row_tokens = [greedy_rule(context + guesses[:i]) for i in range(len(guesses) + 1)]
        kept = 1
        while kept <= len(guesses) and guesses[kept - 1] == row_tokens[kept - 1]:
            kept += 1
        for token in row_tokens[:kept]:
            request.append_output_token(token)
        steps += 1
    assert request.all_token_ids[: len(expected)] == expected
    assert steps <= 100, steps


def test_lookahead_window_rows_attend_as_the_papers_mask_and_iterate():
    """As published: row (level l, column i) of a W x (N - 1) window sees the last token, level 0's
    columns 0..i and column i's levels 1..l (its trajectory), at position l + i + 1 (Fu et al.'s
    figure 2 mask); the pool's candidate n-grams are branches from the last token beside it
    (sharing their first node). After a step the levels move down, the top level takes the top
    rows' draws, each column with its draw is an n-gram, and kept tokens beyond one move the window."""
    width, n = 4, 4
    levels = [[100 + 10 * l + i for i in range(width)] for l in range(n - 1)]
    candidates = [[1, 2, 3], [1, 5, 6]]
    tokens, parents, tops = lookahead_tree(JacobiWindow([list(level) for level in levels]), candidates, 99)
    masks = ancestor_masks(parents)
    assert len(tokens) == 5 + width * (n - 1)
    for l in range(n - 1):
        for i in range(width):
            node = tokens.index(levels[l][i])
            seen = {tokens[j - 1] for j in range(1, len(masks)) if masks[node + 1] >> j & 1}
            assert seen == {levels[0][j] for j in range(i + 1)} | {levels[m][i] for m in range(1, l + 1)}
            assert masks[node + 1].bit_count() - 1 == l + i + 1  # its position past the last token
    assert [tokens[t] for t in tops] == levels[-1]
    assert [_branch_of(tokens, parents, tokens.index(c[-1])) for c in candidates] == candidates
    cut = lookahead_tree(JacobiWindow([list(level) for level in levels]), candidates, 9)
    assert len(cut[0]) == 9 and cut[2] == [tops[0], None, None, None]

    window = JacobiWindow([list(level) for level in levels])
    draws = [7, None, 8, 9]
    trajectories = window.advance(draws, 1, fill=[50, 51, 52, 53])
    assert trajectories == [[levels[0][i], levels[1][i], levels[2][i], draws[i]] for i in (0, 2, 3)]
    assert window.levels == [levels[1], levels[2], [7, 51, 8, 9]]  # an unverified column: from the text
    window.advance([1, 2, 3, 4], 3, fill=[60, 61, 62, 63])  # three tokens kept: two columns leave
    assert window.levels == [levels[2][2:] + [62, 63], [8, 9, 62, 63], [3, 4, 62, 63]]


def run_lookahead_tree(proposer: LookaheadProposer, expected: list[int]) -> int:
    """Verification of the published step simulated with greedy_rule as the model: each row draws
    the rule's token after its branch; the longest path of guesses equal to their parent's draw is
    kept, then one more draw. Returns the steps that made `expected` (checked)."""
    request = Request("r", expected[:2])
    row_tokens = [greedy_rule(request.all_token_ids)]
    request.append_output_token(row_tokens[0])
    steps = 1
    while request.num_tokens < len(expected):
        guesses, parents = proposer.propose_tree(request, 15, row_tokens)
        context = list(request.all_token_ids)
        row_tokens = [greedy_rule(context)] + [greedy_rule(context + _branch_of(guesses, parents, node))
                                               for node in range(len(guesses))]
        path = accepted_path(parents, [g == row_tokens[p + 1] for g, p in zip(guesses, parents)])
        for row in [0] + [node + 1 for node in path]:
            request.append_output_token(row_tokens[row])
        steps += 1
    assert request.all_token_ids[: len(expected)] == expected
    return steps


def test_lookahead_as_published_keeps_the_greedy_text_in_fewer_steps():
    """The published step (3 x 3 window rows, two pool n-grams: 15 guesses) keeps the rule's
    greedy text, in fewer steps than 200 tokens at least by a third."""
    expected = [1, 2]
    while len(expected) < 202:
        expected.append(greedy_rule(expected))
    steps = run_lookahead_tree(LookaheadProposer(4, window=3, guesses=2), expected)
    assert steps <= 133, steps


def test_guess_count_follows_acceptance_and_batch_size():
    rate = AcceptanceRate()
    assert rate.rate == PRIOR_RATE
    assert num_guesses(rate, 31, 4, 32) == 1  # unmeasured: one guess measures it, even in a busy batch
    assert num_guesses(rate, 1, 8, 32) > 1  # and alone, the hopeful prior's count
    high, low = AcceptanceRate(), AcceptanceRate()
    for _ in range(10):
        high.update(4, 4)
        low.update(4, 0)
    assert high.rate > 0.9 and low.rate < 0.3
    assert num_guesses(high, 1, 4, 32) == 4
    assert num_guesses(low, 1, 4, 32) == 0  # a guess kept 1 time in 10 never pays for its row
    counts = [num_guesses(high, batch, 4, 32) for batch in (1, 8, 16, 24, 31, 32, 64)]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-3] and counts[-2:] == [0, 0]
    # the count of most expected tokens per cost (Leviathan et al.), against a direct search over
    # every count: steps of B rows plus guesses cost 1 + ROW_COST (B - 1 + guesses) one-row steps
    for batch in (1, 3, 8):
        def tokens_per_cost(k: int) -> float:
            expected = sum(high.rate ** i for i in range(k + 1)) * batch
            return expected / (1 + ROW_COST * (batch - 1 + batch * k))
        assert num_guesses(high, batch, 12, 32) == max(range(13), key=tokens_per_cost)


def test_speed_gate_stops_guessing_while_guessing_is_measured_slower():
    gate = SpeedGate()
    assert gate.allow()  # nothing measured yet: guess
    gate.record(True, num_tokens=600, num_requests=2, seconds=1.0)  # the first step of an option: not counted
    assert gate.speed[True] is None
    gate.record(True, num_tokens=6, num_requests=2, seconds=1.0)  # 3 tokens/s per request with guesses
    assert not gate.allow()  # then measure plain steps
    gate.record(False, num_tokens=1, num_requests=2, seconds=1.0)  # the switch's step: not counted
    gate.record(False, num_tokens=8, num_requests=2, seconds=1.0)  # 4 tokens/s per request without
    decisions = [gate.allow() for _ in range(PROBE_EVERY + 2 * PROBE_STEPS)]
    assert sum(decisions) == PROBE_STEPS  # only a probe guesses, PROBE_STEPS steps in a row
    assert any(decisions[i : i + PROBE_STEPS] == [True] * PROBE_STEPS for i in range(PROBE_EVERY + 1))
    for _ in range(20):
        gate.record(True, num_tokens=20, num_requests=2, seconds=1.0)  # guessing becomes faster
    assert sum(gate.allow() for _ in range(PROBE_EVERY)) == PROBE_EVERY


def test_speed_gate_probes_less_often_while_probes_confirm_the_preference():
    """Gaps between probes: PROBE_EVERY, doubling up to PROBE_EVERY_MAX while the slower option stays
    slower; back to PROBE_EVERY after a probe that finds it faster."""
    gate = SpeedGate()
    gate.allow()
    for with_guesses, tokens in ((True, 1), (True, 2), (False, 1), (False, 8)):  # guessing slower
        gate.record(with_guesses, num_tokens=tokens, num_requests=1, seconds=1.0)
    decisions = "".join("g" if gate.allow() else "." for _ in range(1000))
    probes = [m.span() for m in re.finditer("g+", decisions)]
    assert all(end - start == PROBE_STEPS for start, end in probes)
    gaps = [probes[0][0] + 1] + [b[0] - a[1] for a, b in zip(probes, probes[1:])]
    doubling = [PROBE_EVERY * 2 ** i for i in range(len(gaps))]
    assert gaps == [min(gap, PROBE_EVERY_MAX) for gap in doubling]
    assert gaps[-1] == PROBE_EVERY_MAX
    while gate.allow() is False:  # up to the next probe, where guessing measures faster
        pass
    for _ in range(10):
        gate.record(True, num_tokens=50, num_requests=1, seconds=1.0)
    decisions = "".join("g" if gate.allow() else "." for _ in range(PROBE_EVERY + 2 * PROBE_STEPS))
    assert decisions.startswith("g" * (PROBE_EVERY + PROBE_STEPS - 1))  # guessing preferred now
    assert "." * PROBE_STEPS in decisions  # and plain steps probed PROBE_EVERY steps after
