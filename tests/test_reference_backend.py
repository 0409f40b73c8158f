"""The reference backend on a real quantized model: SmolLM2-135M-Instruct's Q4_1 GGUF
(../shared/data/models/smollm2-135m-instruct) against transformers, which reads the same file and
dequantizes every weight to float32 (gguf's dequantizer): dequantize-then-matmul, no activation
rounded, gives its logits within 1e-4."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hearth.backend import choose_backend
from hearth.backend.cpu_linear import HalfLinear, Int8Linear
from hearth.engine.runner import BatchEntry, ModelRunner
from hearth.loading.loader import load_model

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "smollm2-135m-instruct"
GGUF = DATA / "SmolLM2-135M-Instruct.Q4_1.gguf"

pytestmark = pytest.mark.skipif(not GGUF.exists(), reason=f"reference data not found: {DATA}")


def transformers_model(path: Path):
    """transformers' llama with the GGUF's weights as transformers dequantizes them (its own GGUF
    reader, Q/K rows un-permuted as it does; from_pretrained(gguf_file=) would do the same but needs accelerate)."""
    import functools

    import gguf
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers parses the file in each of the two calls and builds gguf's tensor-name table
    # once per module (~400 times): the same read-only objects, made once here (30 s of CPU -> 19 s)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.lru_cache(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        config = AutoConfig.for_model(**load_gguf_checkpoint(str(path))["config"])
        with no_init_weights():  # every weight comes from the file (3 s of CPU to draw random ones first)
            model = LlamaForCausalLM(config).eval()
        keys = model.load_state_dict(load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"],
                                     strict=False)
    assert keys.missing_keys == ["lm_head.weight"] and not keys.unexpected_keys
    model.tie_weights()  # the file has no output tensor: lm_head is token_embd
    return model


def test_reference_backend_equals_transformers_fp32_logits():
    ids = json.loads((DATA / "llamacpp_reference.json").read_text())["teacher_forced"][0]["ids"][:64]
    with torch.no_grad():
        reference = transformers_model(GGUF)
        want = reference(torch.tensor([ids])).logits[0]
        exact = reference.double()(torch.tensor([ids])).logits[0]
    model = load_model(GGUF, progress=False, backend=choose_backend(torch.device("cpu"), torch.float32,
                                                                      "reference")).model
    assert not any(isinstance(m, (Int8Linear, HalfLinear)) for m in model.modules())  # no activation rounded
    runner = ModelRunner(model, 4, 16, torch.device("cpu"), torch.float32)
    hidden, _ = runner.forward([BatchEntry(ids, 0, [0, 1, 2, 3])])
    ours = model.compute_logits(hidden)
    assert (ours - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    # 1e-4 absolute is below float32's own precision at logits of ~38: transformers' fp32 logits sit
    # 1.0-1.7e-4 from its float64 ones, hearth's 1.5-2.0e-4 (summation orders differ by CPU kind: AVX2 or AVX-512
    # EPYC, Xeon). The reference backend stays within float32's error of float64: 1e-5 of the largest logit
    # (~100 float32 steps after 30 layers); int8 activations sit ~0.5 off.
    assert (ours.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    assert (want.double() - exact).abs().max() <= 1e-5 * exact.abs().max()  # the bound holds transformers' own
