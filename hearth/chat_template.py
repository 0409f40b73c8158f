"""Chat templates: a model's Jinja template rendered the way transformers renders it.

Same environment as transformers' `apply_chat_template` (sandboxed, trim_blocks, lstrip_blocks,
loop controls, `raise_exception`, `strftime_now`, a `tojson` that does not escape HTML, a no-op
`{% generation %}` block) and the same variables (messages, tools, documents,
add_generation_prompt, the special tokens, extra keyword arguments). Every failure, from a
syntax error to a template's own `raise_exception`, comes out as a RequestError.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hearth.errors import HearthError, RequestError


def render_chat_template(
    template: str | None,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    **variables: Any,
) -> str:
    """The prompt text; variables (bos_token, eos_token, tools, enable_thinking...) reach the template."""
    if not template:
        raise RequestError("model has no chat template")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RequestError("messages must be a list of objects with 'role' and 'content'")
    compiled = _compile(template)
    context = {"tools": None, "documents": None, **variables}
    try:
        return compiled.render(
            messages=copy.deepcopy(messages), add_generation_prompt=add_generation_prompt, **context
        )
    except RequestError:
        raise
    except jinja2.TemplateError as e:
        raise RequestError(f"chat template error: {e.message or type(e).__name__}") from None
    except Exception as e:  # a template is code: it can fail in any Python way on unexpected input
        raise RequestError(f"chat template error: {type(e).__name__}: {e}") from None


def load_chat_template(source: str) -> str:
    """`--chat-template`'s value: a Jinja file's text, or the template itself (vLLM takes both);
    HearthError for a file that cannot be read, or text that is neither."""
    if "{{" in source or "{%" in source:  # the text itself (as a path it may be too long for the OS)
        return source
    path = Path(source).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise HearthError(f"chat template {source}: cannot read it: {e}") from None
    raise HearthError(f"chat template {source}: no such file (give a Jinja file, or the template's text)")


class _TemplateRaised(jinja2.TemplateError):
    """What `raise_exception(...)` in a template raises (turned into RequestError on the way out)."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' filter: plain json.dumps (Jinja's own escapes <, >, & and ' for HTML)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes (no reaching into Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's own signature trick)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return caller()


# the longest string or list a template may build by repetition ('x' * n), and the most bits of
# a power (10 ** 10 ** 10 would compute for ever): a template comes with the model file, from anyone
MAX_REPEAT = 1 << 20
MAX_POWER_BITS = 1 << 12


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja's sandbox (no attribute of Python's internals, no file, range() bounded), with the two
    operators that can exhaust memory or time bounded too."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for items, times in ((left, right), (right, left)):
                if isinstance(items, (str, list, tuple)) and isinstance(times, int) and len(items) * times > MAX_REPEAT:
                    raise SecurityError(f"repetition longer than {MAX_REPEAT:,} items")
        elif isinstance(left, int) and isinstance(right, int) and right * abs(left).bit_length() > MAX_POWER_BITS:
            raise SecurityError(f"a power of more than {MAX_POWER_BITS:,} bits")
        return super().call_binop(context, operator, left, right)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise RequestError(f"chat template does not compile: {e}") from None
