"""CALM early exit (hearth/model/calm.py) against CALM's decoding written out here on transformers'
modules of the same random-weight Llama (fp32): per token the layers one at a time, after each exit
layer the final norm and LM head on the hidden state there, an exit where the top-1 minus top-2
probability reaches the request's threshold, and the skipped layers' K/V projected from that hidden
state (Schuster et al. 2022's state propagation). Requests with and without a threshold side by side."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from hearth import LLM, SamplingParams
from hearth.errors import RequestError
from models import VOCAB_SIZE, load_hf_reference, make_hf_model

EXIT_LAYERS = (1, 2)  # of 4
MAX_TOKENS = 10
LM_HEAD_SCALE = 25.0


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """4 layers; the LM head scaled up so that the intermediate predictions range from flat to confident."""
    folder = make_hf_model(tmp_path_factory.mktemp("calm"), "llama", num_hidden_layers=4)
    model = load_hf_reference(folder)
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    model.save_pretrained(folder)
    return folder


def softmax_response(h_before, h, model) -> float:
    """CALM's softmax response: top-1 minus top-2 probability of the LM head on the normed hidden state."""
    top = model.lm_head(model.model.norm(h))[0, -1].softmax(-1).topk(2).values
    return (top[0] - top[1]).item()


def saturation(h_before, h, model) -> float:
    """CALM's hidden-state saturation: cos(d^(i-1), d^i) of the residual streams of consecutive layers."""
    return torch.nn.functional.cosine_similarity(h_before[0, -1], h[0, -1], dim=0).item()


def calm_greedy(model, prompt: list[int], threshold: float, steps: int, measure=softmax_response,
                gate: tuple | None = None) -> tuple[list[int], list[float], float]:
    """CALM's greedy decoding: the tokens, each one's log-probability under the logits it came from
    (its exit layer's or the last layer's), and the least |confidence - threshold| seen (a margin
    that float rounding cannot cross). measure(d^(i-1), d^i, model): the confidence at exit layer i;
    gate (measure, bound): the confidence counts only where that measure reaches the bound."""
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    inner, cache = model.model, DynamicCache(config=model.config)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    tokens, logprobs, margin = [], [], float("inf")
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), cache=cache, use_cache=True).logits[0, -1]  # the prompt: every layer
        for step in range(steps):
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(logits.log_softmax(-1)[token].item())
            position = torch.tensor([[len(prompt) + step]])
            h = inner.embed_tokens(torch.tensor([[token]]))
            rotary = inner.rotary_emb(h, position_ids=position)
            for index, layer in enumerate(inner.layers):
                h_before, h = h, layer(h, position_ids=position, cache=cache, use_cache=True, position_embeddings=rotary)
                logits = model.lm_head(inner.norm(h))[0, -1]
                if index + 1 not in EXIT_LAYERS:
                    continue
                if gate is not None:
                    passed = gate[0](h_before, h, model)
                    margin = min(margin, abs(passed - gate[1]))
                    if passed < gate[1]:
                        continue
                confidence = measure(h_before, h, model)
                margin = min(margin, abs(confidence - threshold))
                if confidence >= threshold:  # exit: the later layers' K/V from this hidden state
                    for later in inner.layers[index + 1:]:
                        x, attention = later.input_layernorm(h), later.self_attn
                        k = attention.k_proj(x).view(1, 1, -1, head_dim).transpose(1, 2)
                        v = attention.v_proj(x).view(1, 1, -1, head_dim).transpose(1, 2)
                        _, k = apply_rotary_pos_emb(k, k, *rotary)
                        cache.update(k, v, attention.layer_idx)
                    break
    return tokens, logprobs, margin


def test_calm_equals_the_formula_beside_requests_without_it(folder):
    """Two thresholds (chosen where CALM changes some prompt's tokens and no confidence lies within
    1e-4 of them) and requests without one (`calm_threshold` None: every layer, as a plain engine's;
    alone its logprobs bit for bit, in a batch within rounding: a dense matmul's sums depend on the
    rows beside), in one batch and alone."""
    reference = load_hf_reference(folder)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    expected = {}
    plain = [calm_greedy(reference, p, 2.0, MAX_TOKENS)[0] for p in prompts]
    for threshold in (0.2, 0.4, 0.6, 0.8, 0.1, 0.3, 0.5, 0.7, 0.9):
        runs = [calm_greedy(reference, p, threshold, MAX_TOKENS) for p in prompts]
        if min(margin for *_, margin in runs) > 1e-4 and sum(r[0] != q for r, q in zip(runs, plain)) >= 1:
            expected[threshold] = runs
        if len(expected) == 2:
            break
    assert len(expected) >= 2, "no threshold where CALM changes the tokens: the test checks nothing"
    (low, low_runs), (high, high_runs) = sorted(expected.items())

    calm = LLM(folder, progress=False, calm_exit_layers=",".join(map(str, EXIT_LAYERS)))
    plain = LLM(folder, progress=False)
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0, calm_threshold=t)
              for t in (low, None, high)]
    batch = [(prompts[0], params[0], low_runs[0]), (prompts[1], params[1], None), (prompts[1], params[2], high_runs[1]),
             (prompts[2], params[0], low_runs[2]), (prompts[2], params[1], None)]
    outputs = calm.generate([p for p, _, _ in batch], [q for _, q, _ in batch], use_tqdm=False)
    alone = calm.generate([prompts[0]], params[0], use_tqdm=False) + calm.generate([prompts[1]], params[1], use_tqdm=False)
    plain_out = {i: plain.generate([prompts[i]], params[1], use_tqdm=False)[0].outputs[0] for i in (1, 2)}
    for i, ((prompt, _, runs), output) in enumerate(zip(batch + batch[:2], outputs + alone)):
        got = output.outputs[0]
        if runs is None:  # without CALM: the plain engine's tokens and logprobs (alone: bit for bit)
            want = plain_out[prompts.index(prompt)]
            assert got.token_ids == want.token_ids
            got_lp, want_lp = ([lp[t] for lp, t in zip(o.logprobs, o.token_ids)] for o in (got, want))
            assert got_lp == want_lp if i >= len(batch) else torch.allclose(torch.tensor(got_lp), torch.tensor(want_lp), atol=1e-4)
            continue
        tokens, logprobs, _ = runs
        assert got.token_ids == tokens
        # each token's logprob is that of the layer it left at
        torch.testing.assert_close(torch.tensor([lp[t] for lp, t in zip(got.logprobs, got.token_ids)]),
                                   torch.tensor(logprobs), atol=1e-4, rtol=0)
    assert calm.engine.block_manager.check_all_free()

    with pytest.raises(ValueError, match="calm_threshold must be a number in \\[0, 1\\]"):
        SamplingParams(calm_threshold=1.5)
    with pytest.raises(ValueError, match="calm_exit_layers must be increasing layer counts in \\[1, 3\\]"):
        LLM(folder, progress=False, calm_exit_layers="2,4")


def test_calm_is_refused_where_the_engine_cannot_run_it(tmp_path):
    folder = make_hf_model(tmp_path, "llama", num_hidden_layers=1)  # no layer to leave after
    with pytest.raises(RequestError, match="calm_threshold \\(CALM early exit\\) is not implemented for this engine"):
        LLM(folder, progress=False).generate([[5, 6, 7]], SamplingParams(max_tokens=2, calm_threshold=0.5),
                                             use_tqdm=False)


@pytest.fixture(scope="module")
def half_folder(folder, tmp_path_factory):
    """folder's model in float16: its decode steps run in the cpu backend's one kernel call
    (HalfLinear), where the saturation checks run inside the kernel (hearth/backend/cpu_decode.py).
    (float16, not bfloat16: F16 weights' products stay exact on every CPU; BF16 ones take bf16 pairs,
    their activations rounded, on AMD's AVX512_BF16.)"""
    half = tmp_path_factory.mktemp("calm-f16")
    shutil.copytree(folder, half, dirs_exist_ok=True)
    load_hf_reference(folder).to(torch.float16).save_pretrained(half)
    return half


@pytest.mark.parametrize("kernel", [True, False], ids=["decode-kernel", "modules"])
def test_saturation_measures_equal_the_formula(folder, half_folder, kernel):
    """Hidden-state saturation (calm_measure "saturation") and the softmax response gated by it
    ("saturation-softmax") against CALM's formulas on transformers' hidden states, side by side with
    a softmax-response request and one at threshold 1 (never leaves: plain greedy). The float16
    model's steps check inside the decode kernel; the float32 model's run the modules, torch measuring."""
    path = half_folder if kernel else folder
    reference = load_hf_reference(path)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    plain = [calm_greedy(reference, p, 2.0, MAX_TOKENS)[0] for p in prompts]
    cases = [({"calm_measure": "saturation", "calm_threshold": 0.6}, {"threshold": 0.6, "measure": saturation}),
             ({"calm_measure": "saturation-softmax", "calm_threshold": 0.5, "calm_saturation_bound": 0.5},
              {"threshold": 0.5, "gate": (saturation, 0.5)}),
             ({"calm_threshold": 0.5}, {"threshold": 0.5})]
    want = [calm_greedy(reference, p, steps=MAX_TOKENS, **formula) for p, (_, formula) in zip(prompts, cases)]
    assert min(margin for *_, margin in want) > 1e-4, "a confidence within rounding of its threshold"
    assert sum(w[0] != q for w, q in zip(want, plain)) >= 2, "CALM changes no tokens: the test checks nothing"

    llm = LLM(path, progress=False, calm_exit_layers=",".join(map(str, EXIT_LAYERS)))
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0, **given)
              for given in [given for given, _ in cases] + [{"calm_measure": "saturation", "calm_threshold": 1.0}]]
    outputs = llm.generate(prompts + prompts[:1], params, use_tqdm=False)
    for output, (tokens, logprobs, _) in zip(outputs, want + [(plain[0], None, None)]):
        got = output.outputs[0]
        assert got.token_ids == tokens
        if logprobs is not None:  # each token's logprob is that of the layer it left at
            torch.testing.assert_close(torch.tensor([lp[t] for lp, t in zip(got.logprobs, got.token_ids)]),
                                       torch.tensor(logprobs), atol=1e-4, rtol=0)
    views = llm.engine.runner.calm.views
    assert (views[0, len(reference.model.layers)][0].backend_state.get("decode_path") is not None) == kernel
    with pytest.raises(ValueError, match="calm_measure must be one of softmax, saturation, saturation-softmax"):
        SamplingParams(calm_threshold=0.5, calm_measure="entropy")
    with pytest.raises(ValueError, match="calm_saturation_bound must be a number in \\[-1, 1\\]"):
        SamplingParams(calm_threshold=0.5, calm_saturation_bound=2)
