"""The hearth command: perplexity against transformers, inspect, tokenize, convert, and clean errors."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hearth.cli import main
from models import load_hf_reference, make_hf_model

TEXT = (
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    "Once upon a time there was a little fox who lived in the forest. " * 3
)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("cli") / "llama", "llama")


def run_json(capsys, *argv) -> dict:
    assert main([str(a) for a in argv]) == 0
    return json.loads(capsys.readouterr().out)


def reference_perplexity(folder, ids: list[int], context: int) -> tuple[float, int]:
    model = load_hf_reference(folder)
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, context):
            window = torch.tensor([ids[start : start + context]])
            if window.shape[1] < 2:
                break
            logits = model(window).logits[0, :-1]
            total += F.cross_entropy(logits, window[0, 1:], reduction="sum").item()
            count += window.shape[1] - 1
    return math.exp(total / count), count


@pytest.mark.parametrize("context", [16, 1000])
def test_perplexity_equals_transformers(llama, capsys, context):
    from hearth.tokenizer import Tokenizer

    ids = Tokenizer.from_hf_dir(llama).encode(TEXT)
    expected, count = reference_perplexity(llama, ids, min(context, 512))
    result = run_json(capsys, "perplexity", llama, "--text", TEXT, "--context", context, "--json")
    assert result["tokens"] == count
    assert abs(result["perplexity"] - expected) / expected <= 1e-4
    assert math.isclose(math.exp(result["nll"]), result["perplexity"], rel_tol=1e-9)


def test_perplexity_of_a_text_file_and_gguf(llama, capsys, tmp_path):
    text_file = tmp_path / "held_out.txt"
    text_file.write_text(TEXT)
    gguf = tmp_path / "llama.gguf"
    assert main(["convert", str(llama), str(gguf), "--type", "f32"]) == 0
    capsys.readouterr()
    from_folder = run_json(capsys, "perplexity", llama, "--text-file", text_file, "--context", 32, "--json")
    from_gguf = run_json(capsys, "perplexity", gguf, "--text-file", text_file, "--context", 32, "--json")
    assert from_gguf["tokens"] == from_folder["tokens"]
    assert abs(from_gguf["perplexity"] - from_folder["perplexity"]) / from_folder["perplexity"] <= 1e-4


def test_tokenize_agrees_with_tokenizers(llama, capsys):
    from tokenizers import Tokenizer as HFTokenizer

    reference = HFTokenizer.from_file(str(llama / "tokenizer.json"))
    result = run_json(capsys, "tokenize", llama, "Hello world", "--no-special", "--json")
    encoding = reference.encode("Hello world", add_special_tokens=False)
    assert result["ids"] == encoding.ids
    assert result["pieces"] == encoding.tokens


def test_inspect_reports_sizes(llama, capsys, tmp_path):
    hf = json.loads((llama / "config.json").read_text())
    info = run_json(capsys, "inspect", llama, "--kv-budget", "1MiB", "--json")
    reference = load_hf_reference(llama)
    assert info["architecture"] == "llama"
    assert info["parameters"] == sum(p.numel() for p in reference.parameters())
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    element = 2 if torch.cuda.is_available() else 4  # the engine's compute dtype: bfloat16 on a GPU, float32 on a CPU
    per_token = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * head_dim * element
    assert info["kv_cache_bytes_per_token"] == per_token
    assert info["kv_budget_tokens"] == (1 << 20) // per_token
    assert info["context_length"] == hf["max_position_embeddings"]
    gguf = tmp_path / "q8.gguf"
    assert main(["convert", str(llama), str(gguf), "--type", "q8_0"]) == 0
    capsys.readouterr()
    quantized = run_json(capsys, "inspect", gguf, "--json")
    assert "Q8_0" in quantized["weight_types"]
    # q8_0 stores 34 bytes per 32 weights
    q8 = quantized["weight_types"]["Q8_0"]
    assert q8["bytes"] == q8["parameters"] // 32 * 34


def test_generate_json(llama, capsys):
    result = run_json(capsys, "generate", llama, "--prompt", "def f", "--max-tokens", 5, "--temperature", 0, "--json")
    assert result["completion_tokens"] <= 5 and result["finish_reason"] in ("stop", "length")


def test_generate_with_token_tree_speculation(llama, capsys):
    """--speculative-tree-width: the same greedy text as plain decoding (a grammar-constrained
    request too: its guesses stay one chain); a width and a count too large for the decode kernels is a
    clean error."""
    common = ("generate", llama, "--prompt", "a b a b a b a", "--max-tokens", 12, "--temperature", 0, "--json")
    tree = ("--speculative-method", "ngram", "--prompt-lookup-min", 1, "--speculative-tree-width", 3)
    assert run_json(capsys, *common, *tree)["text"] == run_json(capsys, *common)["text"]
    regex = ("--regex", r"[a-z]{2}\d")
    assert run_json(capsys, *common, *tree, *regex)["text"] == run_json(capsys, *common, *regex)["text"]
    assert main([str(a) for a in (*common, *tree[:-1], 4, "--num-speculative-tokens", 4)]) == 1
    err = capsys.readouterr().err
    assert "speculative_tree_width x num_speculative_tokens must be below 16" in err and "Traceback" not in err


def test_generate_with_a_json_schema_regex_or_grammar(llama, capsys, tmp_path):
    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    (tmp_path / "yes.gbnf").write_text('root ::= "yes" | "no"')
    common = ("generate", llama, "--prompt", "Once", "--max-tokens", 100, "--temperature", 1, "--seed", 1, "--json")
    jsonschema.validate(json.loads(run_json(capsys, *common, "--json-schema", tmp_path / "schema.json")["text"]), schema)
    assert re.fullmatch(r"[a-z]{2}\d", run_json(capsys, *common, "--regex", r"[a-z]{2}\d")["text"])
    assert run_json(capsys, *common, "--grammar", tmp_path / "yes.gbnf")["text"] in ("yes", "no")

    (tmp_path / "bad.gbnf").write_text("root ::= nowhere")
    for bad in (("--grammar", tmp_path / "bad.gbnf"), ("--grammar", tmp_path / "missing.gbnf"), ("--regex", "(")):
        assert main([str(a) for a in (*common, *bad)]) == 1
        err = capsys.readouterr().err  # (after the loading messages)
        assert err.splitlines()[-1].startswith("hearth: error: ") and "Traceback" not in err, err


@pytest.mark.parametrize(
    "content,needle",
    [
        (b"", "not a GGUF file"),
        (b"GGUF\x03\x00\x00\x00\x05", "damaged or truncated"),
        (b"PK\x03\x04 a zip file", "not a GGUF file"),
    ],
)
def test_bad_files_give_one_clear_line(tmp_path, capsys, content, needle):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(content)
    assert main(["inspect", str(bad)]) == 1  # (in this process: an escaping exception fails the test too)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert needle in err and str(bad) in err


def test_folder_problems_are_named(tmp_path, llama, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["inspect", str(empty)]) == 1
    assert "no config.json" in capsys.readouterr().err
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((llama / "config.json").read_text())
    assert main(["inspect", str(no_weights)]) == 1
    assert "no weights" in capsys.readouterr().err
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
    assert main(["inspect", str(unknown)]) == 1
    assert "unsupported architecture" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "missing.gguf")]) == 1
    assert "no such file" in capsys.readouterr().err


def test_truncated_gguf_and_unsupported_quant_type(tmp_path, llama, capsys):
    import gguf

    good = tmp_path / "good.gguf"
    assert main(["convert", str(llama), str(good), "--type", "f16"]) == 0
    data = good.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    capsys.readouterr()
    assert main(["inspect", str(truncated)]) == 1
    assert "truncated" in capsys.readouterr().err
    # a tensor of a type hearth does not read (Q8_1: llama.cpp's activation blocks)
    writer = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    reader = gguf.GGUFReader(good)
    for field in reader.fields.values():
        if field.name.startswith(("llama.", "tokenizer.")) and field.name != "tokenizer.ggml.merges":
            value = field.contents()
            if field.name.startswith("llama.") or field.name in ("tokenizer.ggml.model", "tokenizer.ggml.tokens"):
                writer.add_key_value(field.name, value, field.types[0], field.types[-1] if len(field.types) > 1 else None)
    writer.add_tensor("blk.0.attn_q.weight", __import__("numpy").zeros((64, 80), dtype="uint8"),
                      raw_shape=(64, 80), raw_dtype=gguf.GGMLQuantizationType.Q8_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert main(["inspect", str(tmp_path / "iq.gguf")]) == 1
    err = capsys.readouterr().err
    assert "Q8_1" in err and "blk.0.attn_q.weight" in err


def test_chat_keeps_the_conversation_and_its_commands_stay_local(llama):
    """Turns through `hearth chat`: each reply is the greedy continuation of the whole history;
    /help, /system, /reset, /exit and an unknown command are never sent to the model."""
    from hearth import LLM, SamplingParams

    stdin = "/help\nhello\n/system Be brief.\nhow are you\n/reset\nhello\n/nope\n/exit\nnever sent\n"
    result = subprocess.run(
        [sys.executable, "-m", "hearth.cli", "chat", str(llama), "--temperature", "0", "--max-tokens", "6"],
        input=stdin, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "/reset" in result.stderr and "unknown command /nope" in result.stderr  # /help's list, the refusal
    replies = result.stdout.split("\n")[:3]
    llm = LLM(llama, progress=False)
    params = SamplingParams(temperature=0, max_tokens=6)
    system, hello = {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}
    first = llm.chat([hello], params, use_tqdm=False)[0].outputs[0].text
    history = [system, hello, {"role": "assistant", "content": first}, {"role": "user", "content": "how are you"}]
    second = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
    third = llm.chat([system, hello], params, use_tqdm=False)[0].outputs[0].text  # after /reset: the system stays
    assert replies == [first, second, third]


def test_the_quick_exit_runs_the_exit_handlers_and_flushes_the_streams():
    """generate and chat end without the interpreter's teardown (hearth/cli.py, _exit_at_once): the exit
    handlers still run, what was written (still buffered) comes out, and the exit status is the command's."""
    code = ("import atexit, sys; from hearth.cli import _exit_at_once; "
            "atexit.register(lambda: sys.stderr.write('handler ran;')); "
            "sys.stdout.write('buffered reply'); _exit_at_once(3)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert (result.returncode, result.stdout, result.stderr) == (3, "buffered reply", "handler ran;")


def test_chat_json_with_a_chat_template_file(llama, tmp_path, monkeypatch, capsys):
    """`hearth chat --json --chat-template FILE`: a JSON line per reply, the prompt as jinja2 renders the file."""
    import io

    import jinja2

    from hearth import LLM, SamplingParams

    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    path = tmp_path / "plain.jinja"
    path.write_text(template)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main(["chat", str(llama), "--temperature", "0", "--max-tokens", "5", "--json", "--chat-template", str(path)]) == 0
    [reply] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    llm = LLM(llama, progress=False, chat_template=str(path))
    history = [{"role": "user", "content": "hello"}]
    rendered = jinja2.Template(template).render(messages=history, add_generation_prompt=True)
    assert llm.get_tokenizer().decode(llm.render_chat(history)) == rendered
    out = llm.chat(history, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert reply == {"role": "assistant", "content": out.outputs[0].text, "finish_reason": out.outputs[0].finish_reason,
                     "prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.outputs[0].token_ids)}
    assert main(["chat", str(llama), "--chat-template", str(tmp_path / "missing.jinja")]) == 1
    assert "no such file" in capsys.readouterr().err


def test_chat_json_and_json_schema_are_two_flags():
    from hearth.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["chat", "--json"])  # once read as --json-schema's prefix, wanting a FILE
    assert args.json and args.json_schema is None
    args = parser.parse_args(["chat", "--json", "--json-schema", "s.json"])
    assert args.json and args.json_schema == "s.json"
    with pytest.raises(SystemExit):  # no abbreviations at all
        parser.parse_args(["chat", "--json-sch", "s.json"])
