"""hearth quantize --awq (hearth/awq.py): AWQ's scales lower the KL divergence of a quantized real model
from its float32 original, on text the search did not see."""

from __future__ import annotations

import pytest

from hearth.cli import main
from hearth.loading.quantize import quantize_model
from test_quantize import DATA, _kld, _load, _logits


def test_awq_lowers_kld_at_q4_0_on_held_out_text(tmp_path, capsys):
    source, texts = DATA / "stories260K" / "stories260K.gguf", DATA / "smollm2-135m-instruct"
    if not source.exists():
        pytest.skip("../shared/data is not here")
    base = _load(source)
    # calibration: the first half of each text; held out: the second halves (the same kinds of text)
    halves = [base.tokenizer.encode((texts / name).read_text(), add_special_tokens=False)
              for name in ("text-apache-2.0.txt", "text-json-decoder.py.txt")]
    calibration = [t for ids in halves for t in ids[:len(ids) // 2]]
    held_out = [t for ids in halves for t in ids[len(ids) // 2:]]
    (tmp_path / "calibration.txt").write_text(base.tokenizer.decode(calibration))
    reference = _logits(base, held_out, 128)
    plain = _kld(reference, _logits(_load(quantize_model(source, tmp_path / "plain.gguf", "q4_0", progress=False)),
                                     held_out, 128))
    assert main(["quantize", str(source), str(tmp_path / "awq.gguf"), "--type", "q4_0",
                 "--awq", str(tmp_path / "calibration.txt"), "--awq-ctx", "128"]) == 0
    awq = _kld(reference, _logits(_load(tmp_path / "awq.gguf"), held_out, 128))
    # measured: 0.194 plain, 0.182 with AWQ's scales (stories260K's Q4_0: rows of 64 and 172 values;
    # the 172-wide down projections stay F16, so AWQ scales q/k/v and gate/up)
    assert awq < 0.96 * plain
    assert main(["quantize", str(source), str(tmp_path / "x.gguf"), "--type", "q4_0",
                 "--awq", str(tmp_path / "missing.txt")]) == 1
    assert "missing.txt: cannot read" in capsys.readouterr().err
