"""Reasoning models: the split of thinking from the answer (hearth/reasoning.py) on replies as the
families' own chat templates write them, the thinking budget the engine enforces (counted on the
output's token ids), and /v1/chat/completions' reasoning_content, streamed or not, on a random
Qwen 3 with Qwen 3's real chat template."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from hearth import LLM, SamplingParams
from hearth.chat_template import render_chat_template
from hearth.engine_config import EngineConfig, ReasoningConfig
from hearth.engine.async_engine import AsyncEngine
from hearth.engine.engine import LLMEngine
from hearth.reasoning import FORMATS
from hearth.server.app import build_app
from models import make_hf_model
from test_server import serving

TEMPLATES = Path(__file__).resolve().parents[2] / "shared" / "data" / "chat_templates"
QUESTION = [{"role": "user", "content": "Is 7 a prime?"}]
THINKING, ANSWER = "7 has no divisor but 1 and 7.\nSo yes.", "Yes, 7 is a prime."


def template(name: str) -> str:
    path = TEMPLATES / name
    if not path.exists():
        pytest.skip(f"real chat templates not found at {TEMPLATES}")
    return path.read_text()


def written_reply(text: str, reply_message: dict, end: str) -> str:
    """What a template writes for the assistant's reply: the conversation with it, less the generation prompt."""
    prompt = render_chat_template(text, QUESTION, True)
    whole = render_chat_template(text, [*QUESTION, reply_message], False)
    assert whole.startswith(prompt)
    return whole[len(prompt):].split(end)[0]


@pytest.mark.parametrize("name,parser,message,end", [
    ("Qwen-Qwen3-0.6B.jinja", "qwen3", {"reasoning_content": THINKING}, "<|im_end|>"),
    ("openai-gpt-oss-120b.jinja", "gpt_oss", {"thinking": THINKING}, "<|return|>"),
])
def test_a_reply_as_the_template_writes_it_splits_whole_and_streamed(name, parser, message, end):
    reply = written_reply(template(name), {"role": "assistant", "content": ANSWER, **message}, end)
    fmt = FORMATS[parser]
    assert fmt.split(reply) == (THINKING, ANSWER), reply
    for size in (1, 3, 7):  # streamed in pieces: the deltas add up to the same split, markers never leak
        split, reasoning, content = fmt.parser(), "", ""
        for i in range(0, len(reply), size):
            r, c = split.feed(reply[i:i + size])
            reasoning, content = reasoning + r, content + c
            assert "<" not in r + c or "<" in THINKING + ANSWER
        r, c = split.feed("", final=True)
        assert (reasoning + r, content + c) == (THINKING, ANSWER)


def test_a_section_opened_by_the_prompt_and_replies_without_one():
    qwen = FORMATS["qwen3"]
    prompt = render_chat_template(template("Qwen3.5-4B.jinja"), QUESTION, True)
    assert qwen.opened_by(prompt)  # Qwen 3.5's template opens <think> itself
    assert qwen.split(f"{THINKING}\n</think>\n\n{ANSWER}", started=True) == (THINKING, ANSWER)
    closed = render_chat_template(template("Qwen3.5-4B.jinja"), QUESTION, True, enable_thinking=False)
    assert not qwen.opened_by(closed)
    assert qwen.split(ANSWER) == ("", ANSWER)
    assert qwen.split("<think>\nstill thinking") == ("still thinking", "")  # cut short: all reasoning
    assert FORMATS["gpt_oss"].split(ANSWER) == ("", ANSWER)


# ---- a random Qwen 3 with <think> and </think> tokens and Qwen 3's chat template


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    chat_template = template("Qwen-Qwen3-0.6B.jinja")
    folder = make_hf_model(tmp_path_factory.mktemp("reasoning") / "qwen3", "qwen3", seed=3)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    # as Qwen 3's tokenizer has them: added tokens, not special (they stay in decoded text)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llm(qwen3) -> LLM:
    return LLM(qwen3, progress=False, reasoning_parser="qwen3")


def think_ids(llm: LLM) -> tuple[int, int]:
    tokenizer = llm.get_tokenizer()
    [start], [end] = (tokenizer.encode(t, add_special_tokens=False) for t in ("<think>", "</think>"))
    return start, end


def generate(llm: LLM, prompt: list[int], **kw) -> list[int]:
    params = SamplingParams(**{"temperature": 0, "max_tokens": 16, **kw})
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def test_the_budget_closes_the_section_after_exactly_n_tokens(llm):
    start, end = think_ids(llm)
    prompt = llm.render_chat(QUESTION)
    # the model opens the section itself (a bias makes <think> its choice at every position, inside too)
    out = generate(llm, prompt, logit_bias={start: 100}, thinking_token_budget=5)
    assert out == [start] * 6 + [end] + [start] * 6 + [end] + [start] * 2  # closed despite the bias, twice
    # the prompt opens it (as Qwen 3.5's and DeepSeek-R1's templates do): counting starts at the reply
    opened = prompt + llm.get_tokenizer().encode("<think>\n", add_special_tokens=False)
    free = generate(llm, opened, ignore_eos=True)
    assert end not in free[:6]  # (the random model would think on)
    for n in (0, 1, 6):
        out = generate(llm, opened, ignore_eos=True, thinking_token_budget=n)
        assert out[:n] == free[:n] and out[n] == end, (n, out)
    # thinking switched off by the template (enable_thinking=False writes an empty section): no budget
    closed = llm.render_chat(QUESTION, chat_template_kwargs={"enable_thinking": False})
    assert generate(llm, closed, thinking_token_budget=0) == generate(llm, closed)


def test_the_budget_holds_with_speculative_guesses(qwen3, llm):
    """Prompt lookup guesses the repeated <think>: the budget runs out inside a step's accepted
    guesses, whose tokens after it are not kept; the output is plain decoding's."""
    start, end = think_ids(llm)
    spec = LLM(qwen3, progress=False, reasoning_parser="qwen3", speculative_method="ngram",
               speculative_adaptive=False, num_speculative_tokens=4)
    prompt = llm.render_chat(QUESTION)
    out = generate(spec, prompt, logit_bias={start: 100}, thinking_token_budget=5)
    assert out == [start] * 6 + [end] + [start] * 6 + [end] + [start] * 2
    assert spec.engine.spec_decode_totals.num_accepted_tokens > 0  # guesses were taken


def test_a_budget_without_a_reasoning_parser_is_refused(qwen3):
    from hearth.errors import RequestError

    plain = LLM(qwen3, progress=False)
    with pytest.raises(RequestError, match="reasoning_parser"):
        plain.generate(["hello"], SamplingParams(thinking_token_budget=3), use_tqdm=False)
    with pytest.raises(ValueError, match="reasoning_budget needs a reasoning_parser"):
        ReasoningConfig(budget=4)


@pytest.fixture(scope="module")
def client(qwen3):
    config = EngineConfig(reasoning=ReasoningConfig(parser="qwen3", budget=6))
    engine = AsyncEngine(LLMEngine(qwen3, config, progress=False))
    with serving(build_app(engine, "qwen3", trust_request_chat_template=True)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    engine.shutdown()


def ask(client, extra_body: dict | None = None, **kw):
    return client.chat.completions.create(**{"model": "qwen3", "messages": QUESTION, "max_tokens": 14, "temperature": 0,
                                             "extra_body": {"ignore_eos": True, **(extra_body or {})}, **kw})


def test_chat_completions_split_reasoning_streamed_or_not(client, llm):
    start, end = think_ids(llm)
    opening = template("Qwen3.5-4B.jinja")  # its generation prompt opens <think>
    prompt = llm.get_tokenizer().encode_chat(QUESTION, chat_template=opening)
    for budget, extra in ((None, {}), (3, {"thinking_token_budget": 3})):  # the server's budget (6), the request's
        n = 6 if budget is None else budget
        ids = generate(llm, prompt, max_tokens=14, ignore_eos=True, thinking_token_budget=n)
        assert ids[n] == end
        decode = llm.get_tokenizer().decode
        expected = (decode(ids[:n]).strip() or None, decode(ids[n + 1:]).lstrip())
        message = ask(client, extra_body={"chat_template": opening, **extra}).choices[0].message
        assert (message.reasoning_content, message.content) == expected
        reasoning, content = "", ""
        for chunk in ask(client, stream=True, extra_body={"chat_template": opening, **extra}):
            delta = chunk.choices[0].delta if chunk.choices else None
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += (delta.content or "") if delta else ""
        assert (reasoning or None, content) == expected
    # enable_thinking false (chat_template_kwargs): the template writes an empty section; all is content
    message = ask(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    closed = llm.render_chat(QUESTION, chat_template_kwargs={"enable_thinking": False})
    assert message.reasoning_content is None
    assert message.content == llm.get_tokenizer().decode(generate(llm, closed, max_tokens=14, ignore_eos=True)).lstrip()


def test_a_request_s_own_chat_template_makes_the_prompt(client, llm):
    import jinja2

    plain = "{% for m in messages %}<|im_start|>{{ m.role }}: {{ m.content }}{% endfor %}<|im_start|>"
    res = ask(client, max_tokens=1, extra_body={"chat_template": plain})
    rendered = jinja2.Template(plain).render(messages=QUESTION, add_generation_prompt=True)
    assert res.usage.prompt_tokens == len(llm.get_tokenizer().encode(rendered, add_special_tokens=False))
    assert res.usage.prompt_tokens != ask(client, max_tokens=1).usage.prompt_tokens


def test_responses_and_messages_carry_the_reasoning_apart(qwen3, llm):
    """The same split through /v1/responses (a `reasoning` item before the message) and Anthropic's
    /v1/messages (a `thinking` block before the text), streamed or not, on a template whose prompt
    opens the section and a server budget of 2 tokens (neither API has ignore_eos: the random model's
    reply ends where the engine's own does)."""
    import anthropic

    opening = template("Qwen3.5-4B.jinja")
    config = EngineConfig(reasoning=ReasoningConfig(parser="qwen3", budget=2), chat_template=opening)
    prompt = llm.get_tokenizer().encode_chat(QUESTION, chat_template=opening)
    ids = generate(llm, prompt, max_tokens=14, thinking_token_budget=2)
    assert ids[2] == think_ids(llm)[1] and len(ids) > 3, ids  # thinking, the close, an answer
    thinking, answer = llm.get_tokenizer().decode(ids[:2]).strip(), llm.get_tokenizer().decode(ids[3:]).lstrip()
    engine = AsyncEngine(LLMEngine(qwen3, config, progress=False))
    try:
        with serving(build_app(engine, "qwen3")) as url:
            openai_client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
            common = {"model": "qwen3", "temperature": 0}
            r = openai_client.responses.create(input=QUESTION, max_output_tokens=14, **common)
            assert [item.type for item in r.output] == ["reasoning", "message"]
            assert (r.output[0].content[0].text.strip(), r.output_text) == (thinking, answer)
            with openai_client.responses.stream(input=QUESTION, max_output_tokens=14, **common) as stream:
                last = list(stream)[-1]  # response.incomplete when cut at max_output_tokens
            assert last.type == f"response.{r.status}" and last.response.output_text == answer
            assert last.response.output[0].type == "reasoning"
            greedy = {"model": "qwen3", "extra_body": {"temperature": 0}}  # (anthropic 2.14 takes no temperature)
            m = claude.messages.create(messages=QUESTION, max_tokens=14, **greedy)
            assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
                ("thinking", thinking), ("text", answer)]
            with claude.messages.stream(messages=QUESTION, max_tokens=14, **greedy) as stream:
                final = stream.get_final_message()
            assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == answer
    finally:
        engine.shutdown()
