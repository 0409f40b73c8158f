"""CALM early exit (hearth/model/calm.py) against CALM's decoding written out here on transformers'
modules of the same random-weight Llama (fp32): per token the layers one at a time, after each exit
layer the final norm and LM head on the hidden state there, an exit where the top-1 minus top-2
probability reaches the request's threshold, and the skipped layers' K/V projected from that hidden
state (Schuster et al. 2022's state propagation). Requests with and without a threshold side by side."""

from __future__ import annotations

import random

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


def calm_greedy(model, prompt: list[int], threshold: float, steps: int) -> tuple[list[int], list[float], float]:
    """CALM's greedy decoding: the tokens, each one's log-probability under the logits it came from
    (its exit layer's or the last layer's), and the least |confidence - threshold| seen (a margin
    that float rounding cannot cross)."""
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
                h = layer(h, position_ids=position, cache=cache, use_cache=True, position_embeddings=rotary)
                if index + 1 == len(inner.layers):
                    logits = model.lm_head(inner.norm(h))[0, -1]
                elif index + 1 in EXIT_LAYERS:
                    logits = model.lm_head(inner.norm(h))[0, -1]
                    top = logits.softmax(-1).topk(2).values
                    margin = min(margin, abs((top[0] - top[1]).item() - threshold))
                    if top[0] - top[1] >= threshold:  # exit: the later layers' K/V from this hidden state
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
