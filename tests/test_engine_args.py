"""Options declared once: EngineConfig's declaration gives LLM's keywords, the CLI's flags and help,
the replicas' flags and the README's table; `hearth --help` and `--version` start without torch."""

from __future__ import annotations

import inspect
import subprocess
import sys
from dataclasses import dataclass, fields
from importlib.metadata import version
from pathlib import Path

import pytest

from hearth.cli import build_parser
from hearth.engine_config import EngineConfig
from hearth.engine_args import engine_argv, engine_options, flags_table
from hearth.llm import LLM
from hearth.options import build, declared_options, option, section
from hearth.sampling_params import SamplingParams

README = Path(__file__).resolve().parents[1] / "README.md"

# The engine flags hearth had before they were read from the declaration: none may go or be renamed.
FLAGS = ["--dtype", "--device", "--backend", "--enforce-eager", "--kv-cache-memory", "--kv-cache-dtype",
         "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--no-prefix-caching",
         "--no-chunked-prefill", "--threads", "--tensor-parallel-size", "--pipeline-parallel-size",
         "--speculative-method", "--speculative-model", "--num-speculative-tokens", "--prompt-lookup-min",
         "--prompt-lookup-max", "--speculative-disable-by-batch-size", "--no-speculative-adaptive",
         "--speculative-tree-width", "--lookahead-mode", "--lookahead-window", "--lookahead-ngram",
         "--lookahead-guesses", "--exit-layer", "--reasoning-parser", "--reasoning-budget", "--chat-template",
         "--mmproj", "--image-max-tokens", "--image-min-tokens", "--enable-lora", "--lora", "--max-loras", "--max-lora-rank", "--lora-dtype", "--contrastive-model", "--kv-cache-dir",
         "--kv-cache-dir-size", "--kv-cache-ram", "--kv-cache-tier-dtype", "--async-scheduling", "--no-async-scheduling",
         "--activation-sparsity", "--activation-thresholds", "--cascade", "--defer-threshold", "--calm-exit-layers"]


def _without_torch(code: str) -> subprocess.CompletedProcess:
    check = "\nimport sys\nassert 'torch' not in sys.modules, 'torch was imported'\n"
    return subprocess.run([sys.executable, "-c", code + check], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["generate", "--help"],
                                  ["bench", "latency", "--help"]])
def test_help_imports_no_torch(argv):
    done = _without_torch(f"from hearth.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit as e:\n"
                          f"    assert e.code == 0, e.code")
    assert done.returncode == 0, done.stderr
    assert "usage: hearth" in done.stdout


def test_version_is_the_installed_packages_without_torch():
    done = _without_torch("from hearth.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit as e:\n"
                          "    assert e.code == 0, e.code")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"hearth {version('hearth')}"


def test_readme_table_is_the_declarations():
    text = README.read_text(encoding="utf-8")
    start = "<!-- engine flags: written by hearth.engine_args.flags_table() -->\n"
    end = "\n<!-- end of engine flags -->"
    assert start in text and end in text
    table = text[text.index(start) + len(start):text.index(end)]
    assert table == flags_table(), ("README.md's table of engine flags differs from EngineConfig's declaration: "
                                    "paste in the output of python -c 'from hearth.engine_args import flags_table; "
                                    "print(flags_table())'")
    for flag in FLAGS:  # (a switch with both flags names them in one cell: `--x` / `--no-x`)
        assert f"| `{flag}" in table or f"/ `{flag}`" in table


def test_every_option_is_declared_with_help_under_one_name():
    options = declared_options(EngineConfig)
    keywords = [o.keyword for o in options]
    assert len(keywords) == len(set(keywords))
    assert all(o.help.strip() for o in options)
    # generate's and chat's flags are read into SamplingParams by its field names: no engine flag may share one
    assert not {o.keyword for o in options if o.cli} & {f.name for f in fields(SamplingParams)}
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    assert sorted(FLAGS) == sorted(f for a in serve._actions for f in a.option_strings if f in FLAGS)
    assert {f"--{k.replace('_', '-')}" for k in keywords} - set(FLAGS) == {"--seed", "--block-size",
                                                                              "--enable-prefix-caching",
                                                                              "--enable-chunked-prefill",
                                                                              "--speculative-adaptive",
                                                                              "--lora-modules"}


def test_flags_parse_to_the_keywords_and_defaults_of_the_declaration():
    parser = build_parser()
    defaults = {o.keyword: o.default for o in declared_options(EngineConfig) if o.cli}
    assert engine_options(parser.parse_args(["serve"])) == defaults
    assert engine_options(parser.parse_args(["generate", "--prompt", "x"])) == defaults | {"max_num_seqs": 1}
    argv = ["serve", "--no-prefix-caching", "--max-num-seqs", "3", "--kv-cache-memory", "2GiB", "--kv-cache-dtype",
            "q8_0", "--speculative-method", "ngram", "--no-speculative-adaptive", "--max-model-len", "64",
            "--no-async-scheduling"]
    given = engine_options(parser.parse_args(argv))
    assert given == defaults | {"enable_prefix_caching": False, "max_num_seqs": 3, "kv_cache_memory": 2 << 30,
                                "kv_cache_dtype": "q8_0", "speculative_method": "ngram",
                                "speculative_adaptive": False, "max_model_len": 64, "async_scheduling": False}
    config = EngineConfig.from_options(**given)
    assert (config.cache.enable_prefix_caching, config.scheduler.max_num_seqs, config.cache.kv_cache_memory,
            config.scheduler.max_model_len, config.speculative.adaptive, config.scheduler.async_scheduling
            ) == (False, 3, 2 << 30, 64, False, False)
    # the replicas' flags: the same options again
    assert engine_options(parser.parse_args(["serve", *engine_argv(**given)])) == given
    assert engine_argv(threads=2, enable_chunked_prefill=True, max_model_len=None) == ["--threads", "2"]
    assert engine_argv(async_scheduling=False) == ["--no-async-scheduling"]  # a switch with both flags
    assert engine_options(parser.parse_args(["serve", "--async-scheduling"]))["async_scheduling"] is True
    assert engine_argv(async_scheduling=True) == ["--async-scheduling"]
    # a repeatable flag (--lora NAME=PATH): every value, there and back
    loras = engine_options(parser.parse_args(["serve", "--lora", "a=/x", "--lora", "b=/y"]))
    assert loras == defaults | {"lora_modules": ("a=/x", "b=/y")}
    assert engine_options(parser.parse_args(["serve", *engine_argv(**loras)])) == loras



def test_replicas_parse_a_private_key_that_starts_with_a_dash():
    from hearth.fleet.launch import replica_argv

    parser = build_parser()
    user = ["serve", "builtin", "--max-num-seqs", "3"]
    args = parser.parse_args(user)
    args.argv, args.replica_api_key = user, "-dash-first_key"  # token_urlsafe gives one in 64 such keys
    replica = parser.parse_args(["serve", *replica_argv(args, "127.0.0.1", threads=2)])
    assert (replica.api_key, replica.port, replica.max_num_seqs, replica.threads) == ("-dash-first_key", 0, 3, 2)

def test_llm_shows_and_names_its_keywords():
    shown = inspect.signature(LLM).parameters
    assert {o.keyword: o.default for o in declared_options(EngineConfig)}.items() <= {
        name: p.default for name, p in shown.items()}.items()
    assert list(shown)[:2] == ["model", "progress"]
    with pytest.raises(TypeError, match=r"LLM\(\) got an unexpected keyword argument 'max_num_seq' "
                                        r"\(did you mean 'max_num_seqs'\?\)"):
        LLM("model.gguf", max_num_seq=8)
    with pytest.raises(TypeError, match="'cache'"):
        LLM("model.gguf", cache={"block_size": 8})  # a nested config is not a keyword; its options are


def test_keywords_reach_their_nested_configs_and_are_checked_there():
    config = EngineConfig.from_options(block_size=8, max_num_batched_tokens=64, pipeline_parallel_size=2,
                                       dtype="float32")
    assert (config.cache.block_size, config.scheduler.max_num_batched_tokens, config.parallel.pipeline_parallel_size,
            config.dtype) == (8, 64, 2, "float32")
    assert config.scheduler.max_num_seqs is None and config.parallel.split  # (None: the engine's count, 256 or fewer)
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1"):
        EngineConfig.from_options(max_num_seqs=0)
    with pytest.raises(ValueError, match="tensor and pipeline parallelism together"):
        EngineConfig.from_options(tensor_parallel_size=2, pipeline_parallel_size=2)
    # a size as text, read as its flag reads it (LLM(kv_cache_memory="1GiB")); a bad one named
    sized = EngineConfig.from_options(kv_cache_memory="1GiB", kv_cache_ram="512", kv_cache_dir_size=4096)
    assert (sized.cache.kv_cache_memory, sized.cache.kv_cache_ram, sized.cache.kv_cache_dir_size) == (
        2**30, 512 * 2**20, 4096)
    with pytest.raises(ValueError, match="kv_cache_memory: not a size: '1 lots'"):
        EngineConfig.from_options(kv_cache_memory="1 lots")


@dataclass
class _Draft:  # a stand-in for any nested config: names of its own, flat keywords by `keyword=`
    method: str | None = option(None, keyword="draft_method", help="how")
    tokens: int = option(4, help="how many")
    adaptive: bool = option(True, keyword="draft_adaptive", flag="--no-draft-adaptive", help="adapt")


@dataclass
class _Top:
    name: str = option("x", help="a name")
    draft: _Draft = section(_Draft, "drafting")


def test_any_nested_dataclass_is_flattened_by_its_declaration():
    options = declared_options(_Top)
    assert [(o.path, o.keyword, o.group, o.kind, o.flag) for o in options] == [
        (("name",), "name", "engine", str, "--name"),
        (("draft", "method"), "draft_method", "drafting", str, "--draft-method"),
        (("draft", "tokens"), "tokens", "drafting", int, "--tokens"),
        (("draft", "adaptive"), "draft_adaptive", "drafting", bool, "--no-draft-adaptive"),
    ]
    top = build(_Top, {"draft_method": "ngram", "tokens": 2}, "Top()")
    assert top == _Top(draft=_Draft(method="ngram", tokens=2))
    with pytest.raises(TypeError, match=r"Top\(\) got an unexpected keyword argument 'method'"):
        build(_Top, {"method": "ngram"}, "Top()")


def test_a_field_without_its_help_is_refused():
    @dataclass
    class Plain:
        size: int = 1

    with pytest.raises(TypeError, match=r"Plain.size: declare it with option\(...\), its help included"):
        declared_options(Plain)
