"""Options declared once: a dataclass field carries its help, and where they differ its keyword and flag.

EngineConfig (hearth/engine_config.py) declares the engine's options with `option(...)` fields, grouped
in nested dataclasses as vLLM groups them (cache, scheduler, parallel, speculative). Everything
else is read from that declaration: LLM's flat keywords (`LLM(model, max_num_seqs=8)` goes to
`config.scheduler.max_num_seqs`: `build`), the CLI's flags and their help (hearth/engine_args.py),
and the README's table of flags (tests/test_engine_args.py keeps it in step).

A field's keyword is its name unless `keyword=` says otherwise (a nested field whose name alone
is ambiguous, such as a speculative config's `method`: keyword "speculative_method"); its flag
is the keyword with dashes unless `flag=` says otherwise (a switch that is on by default:
`--no-prefix-caching`). Only the standard library is imported: the CLI builds its parser, and
answers --help, without torch.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import inspect
import re
import typing
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> int:
    """'4GiB', '512MB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4GiB, 512MB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_size_mib(text: str) -> int:
    """parse_size, but a bare number counts MiB (llama.cpp's --cache-ram): '8192' -> 8 GiB."""
    return int(float(text) * 2**20) if re.fullmatch(r"\s*[0-9.]+\s*", text) else parse_size(text)


def option(default: Any = MISSING, *, help: str, keyword: str | None = None, flag: str | None = None,
           choices: Sequence[Any] | None = None, parse: Callable[[str], Any] | None = None,
           metavar: str | None = None, group: str | None = None, cli: bool = True, negatable: bool = False,
           aliases: tuple[str, ...] = ()) -> Any:
    """A dataclass field that is one of the engine's options.

    help: what it does, for --help and the README (argparse's %(default)s may be used); keyword: the
    flat name of LLM's keyword and of the parsed CLI argument (default: the field's name); flag: the
    CLI flag (default: --keyword-with-dashes; a switch gives its flag, store_true or store_false
    following the default); parse: reads the flag's text (default: the declared type); group: the
    --help section (default: the nested config's); cli: False for an option with no flag; negatable: a
    switch with both flags, --flag and --no-flag (vLLM's --async-scheduling / --no-async-scheduling);
    aliases: more flags for it (another project's name, such as llama.cpp's --cache-ram).
    """
    meta = {"help": help, "keyword": keyword, "flag": flag, "choices": choices, "parse": parse,
            "metavar": metavar, "group": group, "cli": cli, "negatable": negatable, "aliases": aliases}
    return field(default=default, metadata=meta)


def section(config: type, title: str) -> Any:
    """A field holding a nested config (its options are flattened into the keywords); `title` heads
    its options in --help."""
    return field(default_factory=config, metadata={"group": title})


@dataclass(frozen=True)
class Option:
    """One declared option: where it sits in the config, how it is named outside, what it takes."""

    path: tuple[str, ...]  # ("scheduler", "max_num_seqs"): attributes from the top config
    keyword: str
    flag: str
    group: str
    hint: Any  # its declared type: int | None
    default: Any
    help: str
    choices: Sequence[Any] | None
    parse: Callable[[str], Any] | None
    metavar: str | None
    cli: bool
    negatable: bool = False
    aliases: tuple[str, ...] = ()  # more flags for it

    @property
    def kind(self) -> type:
        """The type of its values: int for `int | None`."""
        return next(t for t in typing.get_args(self.hint) or (self.hint,) if t is not type(None))


@functools.cache  # a declaration does not change, and reading its type hints is slow (~2 ms a config)
def declared_options(config: type, group: str = "engine", path: tuple[str, ...] = ()) -> tuple[Option, ...]:
    """Every option of `config`, nested configs' included, in declaration order; TypeError for a field
    declared without option(...)."""
    found: list[Option] = []
    hints = typing.get_type_hints(config)
    for spec in fields(config):
        if is_dataclass(spec.default_factory):
            found += declared_options(spec.default_factory, spec.metadata.get("group", spec.name), (*path, spec.name))
            continue
        if "help" not in spec.metadata:
            raise TypeError(f"{config.__name__}.{spec.name}: declare it with option(...), its help included")
        meta = spec.metadata
        keyword = meta["keyword"] or spec.name
        found.append(Option((*path, spec.name), keyword, meta["flag"] or "--" + keyword.replace("_", "-"),
                            meta["group"] or group, hints[spec.name], spec.default, meta["help"], meta["choices"],
                            meta["parse"], meta["metavar"], meta["cli"], meta.get("negatable", False),
                            meta.get("aliases", ())))
    return tuple(found)


def keywords_of(config: type) -> Callable[[Callable], Callable]:
    """A decorator: the function (taking **options for `config`) is shown by help() and IDEs with each
    option as a keyword, with its type and default, in place of the **options."""

    def show(function: Callable) -> Callable:
        signature = inspect.signature(function)
        params = [p for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD]
        params += [inspect.Parameter(o.keyword, inspect.Parameter.KEYWORD_ONLY, default=o.default,
                                     annotation=o.hint) for o in declared_options(config)]
        function.__signature__ = signature.replace(parameters=params)
        return function

    return show


def build(config: type, keywords: dict[str, Any], caller: str) -> Any:
    """A `config` from flat keywords (each to its nested config; unnamed ones at their defaults).
    TypeError naming an unknown keyword, as Python's own for `caller`."""
    options = {o.keyword: o for o in declared_options(config)}
    for keyword in keywords:
        if keyword not in options:
            close = difflib.get_close_matches(keyword, options, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"{caller} got an unexpected keyword argument {keyword!r}{hint}")
    values: dict[tuple[str, ...], dict[str, Any]] = {}
    for keyword, value in keywords.items():
        option = options[keyword]
        if option.parse is not None and isinstance(value, str):  # LLM(kv_cache_memory="2GiB"), as the flag reads it
            try:
                value = option.parse(value)
            except (argparse.ArgumentTypeError, ValueError) as error:
                raise ValueError(f"{keyword}: {error}") from None
        values.setdefault(option.path[:-1], {})[option.path[-1]] = value
    return _build(config, (), values)


def _build(config: type, path: tuple[str, ...], values: dict[tuple[str, ...], dict[str, Any]]) -> Any:
    given = dict(values.get(path, {}))
    for spec in fields(config):
        if is_dataclass(spec.default_factory):
            given[spec.name] = _build(spec.default_factory, (*path, spec.name), values)
    return config(**given)
