"""The soak (benchmarks/soak.py) for 30 s on a tiny random model: hostile and ordinary traffic,
a KV cache of 24 blocks so that requests are preempted, bursts past --max-queue.

Its clients send one request after another, so the rate is what the server's core gives: with
answers of at most 24 tokens (the script's default is 48) the same mix of kinds comes about twice
as often, and 30 s see about as many requests start, finish, preempt and free their blocks as 60 s
did (the server's work, not the clock, is what a leak follows); each of the 12 clients opens with
a different kind, so every kind is sent however loaded the machine. Memory is judged from 8 s on.

SLOW BY DESIGN: ~45 s, one of the suite's long tests (marked `soak`; `-m "not soak"` leaves it out).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from models import make_hf_model

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.soak
def test_soak_30_seconds_ends_with_no_5xx_no_leaked_block_and_flat_memory(tmp_path):
    folder = make_hf_model(tmp_path / "llama", "llama")
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "soak.py"), "--model", str(folder), "--duration", "30",
         "--max-tokens", "24", "--kv-cache-memory", "192KiB", "--warmup", "8", "--json", str(out)],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and not report["failures"]
    kinds = report["answers_by_kind"]
    assert kinds["stream"].get("200") and kinds["plain"].get("200") and kinds["cancel"].get("200")
    assert kinds["oversized"] == {"413": kinds["oversized"]["413"]}  # every oversized body refused
    assert set(kinds["malformed"]) == {"400"}
    assert kinds["burst"].get("503")  # bursts past --max-queue were turned away, not queued for ever
    assert report["preemptions"] > 0  # the small KV cache made the engine preempt
    assert report["kv_blocks_used_max"] > 0 and report["kv_blocks_used_end"] == 0
    assert report["rss_mib_end"] <= 1.1 * report["rss_mib_after_warmup"]
    server_errors = [s for counts in kinds.values() for s in counts if s.isdigit() and int(s) >= 500 and s != "503"]
    assert not server_errors
