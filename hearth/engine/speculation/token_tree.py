"""Token trees: several speculative branches verified in one pass. Host lists and arrays only, no tensors.

A tree of guesses is two lists: the guessed tokens and each one's parent (-1: the request's last
real token, the root; else the index of an earlier guess), parents always before their children,
siblings never the same token. The step that verifies it has one row per node, the root first,
each row's K/V written to the sequence's next slot in that order; a row attends to the context
before the root and, among the tree's rows, to its ancestors and itself (`ancestor_masks`), at the
position of its depth (RoPE). The sampler accepts at most one child per row (sampler.verify_guesses'
rule for sibling guesses); the accepted path's K/V are then moved into the slots right after the
context (runner.py) and the rest given back, as rejected guesses of a chain are.

A chain is the tree whose parents are -1, 0, 1, ...: every function here gives a chain's
answers for it.
"""

from __future__ import annotations

import numpy as np

from hearth.config import MAX_DECODE_QUERY_LEN


def tree_of(branches: list[list[int]]) -> tuple[list[int], list[int]]:
    """The tree holding each branch (a token sequence from the root) with shared prefixes merged:
    (tokens, parents), the first branch's nodes first (trimming from the end keeps the best)."""
    tokens, parents, _ = tree_paths(branches)
    return tokens, parents


def tree_paths(branches: list[list[int]]) -> tuple[list[int], list[int], list[list[int]]]:
    """tree_of's (tokens, parents), and each branch's nodes in order (where its tokens went)."""
    tokens, parents, paths = [], [], []
    children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for branch in branches:
        node, path = -1, []
        for token in branch:
            if (node, token) not in children:
                children[node, token] = len(tokens)
                tokens.append(token)
                parents.append(node)
            node = children[node, token]
            path.append(node)
        paths.append(path)
    return tokens, parents, paths


def chain(num_guesses: int) -> list[int]:
    """The parents of a chain of guesses."""
    return list(range(-1, num_guesses - 1))


def ancestor_masks(parents: list[int]) -> list[int]:
    """The verification's rows (the root, then each guess) as bit masks over those rows: bit j set
    = the row sees row j (its ancestors and itself). A row's depth is its bits set, less one."""
    masks = [1]
    for i, parent in enumerate(parents):
        masks.append(masks[parent + 1] | 1 << (i + 1))
    return masks


def depth(parents: list[int]) -> int:
    """The longest path of guesses from the root (a chain's: its length)."""
    depths = []
    for parent in parents:
        depths.append(1 + (depths[parent] if parent >= 0 else 0))
    return max(depths, default=0)


def accepted_path(parents: list[int], accepted: list[bool]) -> list[int]:
    """The guesses kept, in order: from the root, each time its child whose guess was accepted
    (at most one per node is), until a node has none."""
    path, node = [], -1
    for i, parent in enumerate(parents):  # parents come before their children: one pass
        if parent == node and accepted[i]:
            path.append(i)
            node = i
    return path


def tree_rows(trees: list[tuple[int, list[int]] | None], starts: np.ndarray, query_start_loc: np.ndarray,
              positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A step's tree_start (int32 [S]) and tree_masks (int64 [T]) (StepInputs), trees[s] sequence s's (the
    region's start, each new row's ancestor mask; None: causal), its rows from starts[s]; positions [T] made
    each tree row's depth's, in place."""
    row_in_seq = positions - np.repeat(starts, np.diff(query_start_loc))
    tree_start = starts.astype(np.int32)
    tree_masks = (np.int64(2) << np.minimum(row_in_seq, 62)) - 1  # causal (read only in decodes)
    for s, tree in enumerate(trees):
        if tree is not None:
            rows = slice(query_start_loc[s], query_start_loc[s + 1])
            if rows.stop - rows.start > MAX_DECODE_QUERY_LEN:
                raise ValueError(f"a token tree step of {rows.stop - rows.start} rows: at most "
                                 f"{MAX_DECODE_QUERY_LEN} go through the decode kernels")
            tree_start[s], tree_masks[rows] = tree[0], tree[1]
            positions[rows] = [tree[0] + mask.bit_count() - 1 for mask in tree[1]]
    return tree_start, tree_masks
