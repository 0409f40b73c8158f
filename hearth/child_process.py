"""A child process that ends with its parent: torch-free, so that what only starts processes (a Ray
actor holding a replica, fleet/replicas.py) need not import torch to use it."""

from __future__ import annotations

import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child process: the kernel sends SIGTERM when the parent goes, however it goes (the
    parent being the thread that started the child)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
