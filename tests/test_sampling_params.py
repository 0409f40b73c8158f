import pytest

from hearth.errors import RequestError
from hearth.sampling_params import BeamSearchParams, SamplingParams, SamplingType


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, None, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert (p.stop, p.stop_token_ids, p.seed, p.logit_bias) == ([], [], None, None)
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert p.sampling_type == SamplingType.RANDOM


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -2),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("n", 0),
        ("presence_penalty", 2.01),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", -2.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("max_tokens", -1),
        ("min_tokens", -1),
        ("logprobs", -2),
        ("prompt_logprobs", -5),
    ],
)
def test_invalid_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_cross_field_checks():
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: 100.5})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: -101})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"x": 1.0})
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["ok", ""])
    with pytest.raises(ValueError, match="n must be 1 when using greedy"):
        SamplingParams(n=2, temperature=0.0)
    # the error is the engine's "bad request" error, which is a ValueError
    with pytest.raises(RequestError):
        SamplingParams(top_p=2)


def test_accepted_edges():
    SamplingParams(top_k=-1)
    SamplingParams(top_k=0)
    SamplingParams(top_k=1)
    SamplingParams(top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2)
    SamplingParams(max_tokens=0, prompt_logprobs=5)  # prompt scoring generates nothing
    SamplingParams(max_tokens=None)
    SamplingParams(best_of=3, n=3, logprobs=0, logit_bias={1: -100, 2: 100})


def test_normalization():
    p = SamplingParams(stop="###", stop_token_ids=[5, 3, 5], logit_bias={"7": 2}, seed=-1)
    assert p.stop == ["###"] and p.stop_token_ids == [5, 3]
    assert p.logit_bias == {7: 2.0}
    assert p.seed is None and p.max_stop_len == 3
    g = SamplingParams(temperature=0, top_p=0.5, top_k=3, min_p=0.2)
    assert g.sampling_type == SamplingType.GREEDY
    assert (g.top_p, g.top_k, g.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=1e-4).temperature == 1e-2  # vLLM raises tiny temperatures


def test_validate_for_vocab():
    SamplingParams(logit_bias={0: 1, 99: 1}, stop_token_ids=[99], top_k=100).validate_for_vocab(100)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={100: 1}).validate_for_vocab(100)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1}).validate_for_vocab(100)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[3, 150]).validate_for_vocab(100)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=101).validate_for_vocab(100)


def test_beam_search_params():
    b = BeamSearchParams(beam_width=4, max_tokens=10)
    assert (b.ignore_eos, b.temperature, b.length_penalty, b.include_stop_str_in_output) == (False, 0.0, 1.0, False)
    for kwargs, field in [
        (dict(beam_width=0, max_tokens=4), "beam_width"),
        (dict(beam_width=2, max_tokens=0), "max_tokens"),
        (dict(beam_width=2, max_tokens=4, temperature=-1), "temperature"),
        (dict(beam_width=2, max_tokens=4, length_penalty=float("inf")), "length_penalty"),
    ]:
        with pytest.raises(ValueError, match=field):
            BeamSearchParams(**kwargs)


def test_from_openai_reads_a_request_body_with_nulls_as_defaults():
    from hearth.sampling_params import StructuredOutputsParams, WatermarkParams

    nulls = {"n": None, "temperature": None, "top_p": None, "top_k": None, "presence_penalty": None, "stop": None,
             "skip_special_tokens": None, "speculative": None, "contrastive_alpha": None, "model": "m", "stream": True}
    assert SamplingParams.from_openai(nulls, max_tokens=16) == SamplingParams()
    body = {"n": 2, "temperature": 0.5, "top_k": 7, "stop": "\n", "logit_bias": {"5": -100}, "seed": 3,
            "watermark": {"key": 9, "delta": 1.0, "gamma": 0.25}, "speculative": False, "logprobs": True,
            "max_tokens": 99, "structured_outputs": {"regex": "x"}}
    regex = StructuredOutputsParams(regex="[0-9]+")
    p = SamplingParams.from_openai(body, max_tokens=8, logprobs=None, prompt_logprobs=2, structured_outputs=regex)
    assert (p.n, p.temperature, p.top_k, p.stop, p.logit_bias, p.seed) == (2, 0.5, 7, ["\n"], {5: -100.0}, 3)
    assert p.watermark == WatermarkParams(9, 1.0, 0.25) and p.speculative is False
    # what the route worked out wins over the body's own field of that name (chat's logprobs is a bool)
    assert (p.max_tokens, p.logprobs, p.prompt_logprobs, p.structured_outputs) == (8, None, 2, regex)


def test_from_cli_reads_generates_flags(tmp_path):
    from hearth.cli import build_parser
    from hearth.errors import HearthError
    from hearth.sampling_params import StructuredOutputsParams, WatermarkParams

    parse = build_parser().parse_args
    p = SamplingParams.from_cli(parse(["generate", "--prompt", "x"]))
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.seed, p.stop) == (
        128, 0.8, 0.95, 0, 0.0, 1.0, None, [])
    assert (p.structured_outputs, p.watermark, p.contrastive_weight, p.contrastive_alpha) == (None, None, 0.0, 0.1)
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "integer"}')
    p = SamplingParams.from_cli(parse(["chat", "--temperature", "0", "--stop", "a", "--stop", "b", "--seed", "4",
                                       "--json-schema", str(schema), "--watermark-key", "7", "--top-k", "3"]))
    assert (p.max_tokens, p.temperature, p.stop, p.seed, p.top_k) == (512, 0.0, ["a", "b"], 4, 0)  # greedy: no top-k
    assert p.structured_outputs == StructuredOutputsParams(json={"type": "integer"})
    assert p.watermark == WatermarkParams(7, 2.0)
    p = SamplingParams.from_cli(parse(["chat", "--penalty-alpha", "0.6", "--top-k", "4"]))  # contrastive search
    assert (p.penalty_alpha, p.top_k, p.sampling_type) == (0.6, 4, SamplingType.GREEDY)
    assert SamplingParams.from_openai({"penalty_alpha": 0.5, "top_k": 3}).penalty_alpha == 0.5
    assert SamplingParams.from_cli(parse(["chat", "--calm-threshold", "0.9"])).calm_threshold == 0.9  # CALM early exit
    assert SamplingParams.from_openai({"calm_threshold": 0.5}).calm_threshold == 0.5
    assert SamplingParams.from_cli(parse(["chat"])).calm_threshold is None
    calm = SamplingParams.from_cli(parse(["chat", "--calm-threshold", "0.95", "--calm-measure", "saturation-softmax",
                                          "--calm-saturation-bound", "0.8"]))
    assert (calm.calm_measure, calm.calm_saturation_bound) == ("saturation-softmax", 0.8)
    calm = SamplingParams.from_openai({"calm_threshold": 0.99, "calm_measure": "saturation"})
    assert (calm.calm_measure, calm.calm_saturation_bound) == ("saturation", 0.9)
    regex = SamplingParams.from_cli(parse(["generate", "--prompt", "x", "--regex", "[a-z]+"]))
    assert regex.structured_outputs == StructuredOutputsParams(regex="[a-z]+")
    with pytest.raises(HearthError, match="missing.lark: cannot read"):
        SamplingParams.from_cli(parse(["generate", "--prompt", "x", "--grammar", str(tmp_path / "missing.lark")]))
