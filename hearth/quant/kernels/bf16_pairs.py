"""BF16 weights as pairs of 16 rows (half_matmul.cpp's BF16_PAIRS), the layout that AVX512_BF16's vdpbf16ps
reads with no gathers: made once at load where those pairs pay (`half_bf16_min_rows`), and read back as rows
(tests, tools, activation sparsity). The same bytes as the rows, but for rows up to a multiple of 16 and a zero
value past an odd K."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pairs_layout(rows: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """BF16 rows, uint8 [n, 2k] -> uint8 [ceil(n / 16), kp * 32]: per group of 16 rows and pair of values
    (2p, 2p + 1), the 16 rows' pairs as uint32 (kp: k rounded up to even; a zero value past an odd k and
    zero rows past n)."""
    groups, kp = -(-n // 16), k + k % 2
    values = rows.contiguous().view(torch.int16).reshape(n, k)
    if groups * 16 != n or kp != k:
        values = F.pad(values, (0, kp - k, 0, groups * 16 - n))
    pairs = values.view(torch.int32).view(groups, 16, kp // 2).transpose(1, 2).contiguous()  # [groups, kp / 2, 16]
    return pairs.view(torch.uint8).reshape(groups, kp * 32)


def rows_of_pairs(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """pairs_layout's inverse: uint8 [ceil(n / 16), kp * 32] -> the rows, uint8 [n, 2k] (a copy)."""
    groups, kp = -(-n // 16), k + k % 2
    words = packed.view(torch.int32).view(groups, kp // 2, 16).transpose(1, 2).reshape(groups * 16, kp // 2)
    return words.view(torch.int16)[:n, :k].contiguous().view(torch.uint8)
