"""Structured output on a random-weights model at temperature 1: every reply is checked by a
reference that is not hearth's (jsonschema's validator, Python's re, the list of choices), and
plain requests beside constrained ones keep their greedy output."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from hearth import LLM, SamplingParams, StructuredOutputsParams
from models import make_hf_model

SCHEMAS = [
    {  # flat, with an enum array and optional fields
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "vip": {"type": "boolean"},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {  # nested objects in an array
        "type": "object",
        "properties": {
            "order": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "items": {
                        "type": "array", "minItems": 1, "maxItems": 2,
                        "items": {
                            "type": "object",
                            "properties": {"sku": {"enum": ["A1", "B2", "C3"]},
                                           "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                            "required": ["sku", "qty"],
                            "additionalProperties": False,
                        },
                    },
                },
                "required": ["id", "items"],
                "additionalProperties": False,
            },
            "paid": {"type": "boolean"},
        },
        "required": ["order", "paid"],
        "additionalProperties": False,
    },
    {  # enums with null, numbers, a const
        "type": "object",
        "properties": {
            "status": {"enum": ["ok", "error", None]},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "version": {"const": 2},
            "note": {"type": ["string", "null"], "maxLength": 4},
        },
        "required": ["status", "ratio", "version"],
        "additionalProperties": False,
    },
    {  # a top-level array of objects
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}, "ok": {"type": "boolean"}},
            "required": ["x", "ok"],
            "additionalProperties": False,
        },
    },
]
REGEXES = [r"[a-z]{3,6}-[0-9]{2,4}", r"(yes|no|maybe)", r"\d{3}-\d{3}-\d{4}", r"[A-Z][a-z]{1,5}( [A-Z][a-z]{1,5}){0,2}\."]
CHOICES = ["Paris", "London", "New York", "東京"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(make_hf_model(tmp_path_factory.mktemp("structured") / "llama", "llama"), progress=False)


def constrained(seed: int, max_tokens: int = 400, **spec) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**spec))


def test_200_json_schema_replies_validate(llm):
    params, schemas = [], []
    for i in range(200):
        schema = SCHEMAS[i % len(SCHEMAS)]
        params.append(constrained(i, json=schema, disable_any_whitespace=i % 3 == 0))
        schemas.append(schema)
    outputs = llm.generate(["Once upon a time"] * len(params), params, use_tqdm=False)
    for p, schema, out in zip(params, schemas, outputs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.text)  # the grammar completed
        value = json.loads(c.text)
        jsonschema.validate(value, schema, cls=jsonschema.Draft202012Validator)
        if p.structured_outputs.disable_any_whitespace:  # no whitespace outside strings
            assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', '""', c.text)), c.text


def test_regex_and_choice_replies_match(llm):
    params = [constrained(i, regex=REGEXES[i % len(REGEXES)]) for i in range(40)]
    params += [constrained(i, choice=CHOICES) for i in range(20)]
    outputs = llm.generate(["The quick brown fox"] * len(params), params, use_tqdm=False)
    for p, out in zip(params, outputs):
        text, spec = out.outputs[0].text, p.structured_outputs
        assert out.outputs[0].finish_reason == "stop"
        if spec.regex is not None:
            assert re.fullmatch(spec.regex, text), (spec.regex, text)
        else:
            assert text in CHOICES
    assert len({o.outputs[0].text for o in outputs[40:]}) > 1  # temperature 1 does choose


@pytest.mark.parametrize("grammar,pattern", [
    ('root ::= "(" num ("+" num)? ")"\nnum ::= [1-9] [0-9]?', r"\((?:[1-9]\d?)(?:\+[1-9]\d?)?\)"),  # llama.cpp GBNF
    ('start: greeting " " NAME\ngreeting: "hi" | "hello"\nNAME: /[a-z]{2,5}/', r"(hi|hello) [a-z]{2,5}"),  # Lark
])
def test_context_free_grammars(llm, grammar, pattern):
    outputs = llm.generate(["Once"] * 8, [constrained(i, grammar=grammar) for i in range(8)], use_tqdm=False)
    for out in outputs:
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"


def test_greedy_output_unchanged_beside_constrained_requests(llm):
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["Once upon a time", "def fibonacci(n):"]
    alone = llm.generate(prompts, plain, use_tqdm=False)
    mixed = llm.generate(prompts + ["The quick brown fox"] * 3,
                         [plain, plain, constrained(1, json=SCHEMAS[1]), constrained(2, regex=REGEXES[0]),
                          SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(
                              choice=CHOICES))], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    assert mixed[4].outputs[0].text in CHOICES  # greedy and constrained at once


def test_n_samples_each_follow_the_grammar(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=400,
                            structured_outputs=StructuredOutputsParams(json=SCHEMAS[3]))
    for c in llm.generate(["Once"], params, use_tqdm=False)[0].outputs:
        jsonschema.validate(json.loads(c.text), SCHEMAS[3])


@pytest.mark.parametrize("spec,needle", [
    (dict(json={"type": "object", "properties": 5}), "properties must be an object"),
    (dict(json={"type": "strung"}), "strung"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(regex="a(b"), "unclosed group"),
    (dict(grammar='root ::= missing'), "missing"),
    (dict(grammar="start: nothing_here"), "nothing_here"),
    (dict(regex="a", choice=["a"]), "exactly one"),
    (dict(choice=[]), "choice"),
])
def test_what_cannot_compile_is_a_clear_value_error(llm, spec, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        llm.generate(["Once"], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_speculation_keeps_seeded_constrained_outputs(llm):
    """Guesses are verified under each position's grammar mask: a seeded constrained request gives
    the same tokens with and without prompt-lookup speculation (which keeps seeded draws)."""
    speculative = LLM(llm.engine.model_path, progress=False, speculative_method="ngram", prompt_lookup_min=1,
                      speculative_adaptive=False)
    params = [constrained(i, json=SCHEMAS[i % len(SCHEMAS)]) for i in range(12)]
    params += [constrained(i, regex=REGEXES[i % len(REGEXES)]) for i in range(12)]
    expected = llm.generate(["Once upon a time"] * len(params), params, use_tqdm=False)
    outputs = speculative.generate(["Once upon a time"] * len(params), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    counts = speculative.engine.spec_decode_totals
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens


def test_draft_speculation_keeps_constrained_outputs_valid(llm):
    """With a draft model (the same model: its guesses ignore the grammar, the target's masks
    reject the ones it forbids), every constrained reply still parses and validates."""
    speculative = LLM(llm.engine.model_path, progress=False, speculative_method="draft",
                      speculative_model=llm.engine.model_path, speculative_adaptive=False)
    params = [constrained(i, json=SCHEMAS[i % len(SCHEMAS)]) for i in range(8)]
    params += [constrained(i, regex=REGEXES[i % len(REGEXES)]) for i in range(8)]
    outputs = speculative.generate(["Once upon a time"] * len(params), params, use_tqdm=False)
    for p, o in zip(params, outputs):
        text = o.outputs[0].text
        if p.structured_outputs.json is not None:
            jsonschema.validate(json.loads(text), json.loads(p.structured_outputs.json)
                                if isinstance(p.structured_outputs.json, str) else p.structured_outputs.json)
        else:
            assert re.fullmatch(p.structured_outputs.regex, text), text
    counts = speculative.engine.spec_decode_totals
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens
