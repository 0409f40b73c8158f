"""llama.cpp's own multimodal path (libmtmd through llama-cpp-python's mtmd_cpp) on the files `hearth convert --mmproj`
writes from a random Gemma 3 and a random Qwen3-VL (tests/models.py; the Qwen text model of three layers: llama.cpp's
qwen3vl graph adds the deepstack rows after the last layer has kept only its output rows, so it aborts where every
layer takes deepstack, as with two), F32: images already of a size neither llama.cpp nor transformers resizes (so no
resampling filter enters), the prompt tokenized by mtmd_tokenize and run by mtmd_helper_eval_chunks (flash attention
off in the encoder). Skipped where llama-cpp-python or its libmtmd does not load (a wheel built without mtmd, or for
instructions this CPU lacks)."""

from __future__ import annotations

import functools

import pytest

from llama_mtmd import MARKER, MtmdRunner
from models import make_gemma3_vl, make_qwen_vl
from optional import import_llama_cpp, import_llama_mtmd
from test_vision import _hearth_logits, _image

QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # as Qwen3-VL's chat template writes an image part
# {family: (the folder's maker, hearth's prompt, the same prompt for mtmd, an image size (height, width) neither
# resizes, the logits' tolerance as a fraction of the largest)}. mtmd puts the tokens around an image itself
# (<start_of_image> / <end_of_image>, <|vision_start|> / <|vision_end|>) at its marker; the blank lines
# Gemma3Processor adds around them are the prompt's.
CASES = {"gemma3": (make_gemma3_vl, "user: What is in <start_of_image>? model:",
                    f"user: What is in \n\n{MARKER}\n\n? model:", (224, 224), 1e-3),
         "qwen3vl": (functools.partial(make_qwen_vl, text={"num_hidden_layers": 3}),
                     f"<|im_start|>user\nWhat is in {QWEN_IMAGE}?<|im_end|>\n<|im_start|>assistant\n",
                     f"<|im_start|>user\nWhat is in {MARKER}?<|im_end|>\n<|im_start|>assistant\n", (128, 96), 3e-3)}
STEPS = 6


@pytest.mark.parametrize("family", list(CASES))
def test_mtmd_runs_hearths_mmproj_as_hearth(family, tmp_path):
    """mtmd's chunks are hearth's prompt ids (the image's positions where hearth's image tokens stand); the
    next-token logits after the prompt within the case's tolerance of the largest (measured: gemma3 1.2e-4, qwen3vl
    1.7e-3, where llama.cpp's image embeddings and its text-only logits each already differ by ~5e-4 of the largest;
    another image moves them by ~0.3 of it), their five best tokens in the same order, six greedy tokens equal."""
    mtmd = import_llama_mtmd()
    llama_cpp = import_llama_cpp()
    from hearth import LLM, SamplingParams
    from hearth.cli import main

    make, prompt, mtmd_prompt, size, tolerance = CASES[family]
    text, mmproj = tmp_path / "text.gguf", tmp_path / "mmproj.gguf"
    assert main(["convert", str(make(tmp_path / family)), str(text), "--type", "f32", "--mmproj", str(mmproj)]) == 0
    image = _image(5, *size)
    llm = LLM(str(text), mmproj=str(mmproj), progress=False)
    ids, logits = _hearth_logits(llm.engine, prompt, [image])
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [image]}},
                       SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True), use_tqdm=False)
    with MtmdRunner(mtmd, llama_cpp, str(text), str(mmproj)) as theirs:
        their_ids = theirs.prefill(mtmd_prompt, image, llm.engine.model_config.vision.image_token_id)
        their_logits = theirs.logits()
        their_tokens = [int(their_logits.argmax())]
        while len(their_tokens) < STEPS:
            theirs.step(their_tokens[-1])
            their_tokens.append(int(theirs.logits().argmax()))
    assert their_ids == ids
    assert (their_logits - logits[-1]).abs().max().item() <= tolerance * logits[-1].abs().max().item()
    assert their_logits.topk(5).indices.tolist() == logits[-1].topk(5).indices.tolist()
    assert their_tokens == out[0].outputs[0].token_ids

