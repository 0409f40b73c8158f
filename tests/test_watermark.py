"""The green-list watermark: generations with it are detected under their key, text without it is
not, and the detector is the plain z-test over green counts (checked against scipy's binomial)."""

from __future__ import annotations

import json
import random

import pytest

from hearth import LLM, SamplingParams, WatermarkParams
from hearth.cli import main
from hearth.watermark import detect
from models import make_hf_model

KEYS = [1, 12345, 2**32 - 5]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(make_hf_model(tmp_path_factory.mktemp("watermark") / "llama", "llama"), progress=False)


def params(seed: int, key: int | None) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=200, ignore_eos=True,
                          watermark=None if key is None else WatermarkParams(key))


def test_watermarked_text_is_detected_and_plain_text_is_not(llm):
    prompts = ["Once upon a time", "def fibonacci(n):", "The quick brown fox"]
    marked = llm.generate(prompts, [params(i, key) for i, key in enumerate(KEYS)], use_tqdm=False)
    plain = llm.generate(prompts, [params(i, None) for i in range(len(KEYS))], use_tqdm=False)
    for key, m, p in zip(KEYS, marked, plain):
        ids = m.outputs[0].token_ids
        assert len(ids) == 200
        assert detect(ids, key).z > 4
        assert abs(detect(p.outputs[0].token_ids, key).z) < 2
        other = KEYS[(KEYS.index(key) + 1) % len(KEYS)]
        assert abs(detect(ids, other).z) < 2  # another key sees no watermark


def test_detect_is_the_binomial_z_test_over_distinct_pairs():
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(0)
    ids = [rng.randrange(5000) for _ in range(3000)]
    score = detect(ids + ids[:50], key=7, gamma=0.5)  # a repeated stretch adds no new pairs but its seam
    assert score.num_scored == len(set(zip(ids + ids[:50], ids[1:] + ids[:50])))
    n, g = score.num_scored, score.num_green
    assert score.z == pytest.approx((g - 0.5 * n) / (n * 0.25) ** 0.5)
    assert 0.001 < stats.binomtest(g, n, 0.5).pvalue  # unwatermarked random ids look like chance


def test_watermark_detect_command(llm, capsys):
    folder = llm.engine.model_path
    out = llm.generate(["Once upon a time"], params(3, KEYS[1]), use_tqdm=False)[0].outputs[0]
    assert main(["watermark", "detect", out.text, "--key", str(KEYS[1]), "--model", str(folder), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["z"] > 4 and result["watermarked"] is True
    assert main(["watermark", "detect", out.text, "--key", str(KEYS[0]), "--model", str(folder)]) == 0
    assert "not watermarked" in capsys.readouterr().out
    assert main(["watermark", "detect", "a", "--key", "1", "--model", str(folder)]) == 1
    assert capsys.readouterr().err.startswith("hearth: error: ")
