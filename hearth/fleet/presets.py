"""Per-model settings for several models in one server: `hearth serve --models-preset FILE`.

An INI file as llama.cpp's router reads one (its --models-preset): a section per model, `[NAME]`, whose
keys are engine flags without their dashes (`kv-cache-dtype = q8_0`, `max-num-seqs = 8`,
`no-prefix-caching = true`, `lora = a=/x, b=/y`), and `model = PATH` for a model the command line does
not name; `[*]` holds what every model gets. A model's engine flags are the command line's, then
`[*]`'s, then its own section's: the more particular setting wins (llama.cpp lets the command line
win; here the command line is the default every model starts from). Read and checked at start-up:
an unknown flag, a bad value or a section for no model stops the server with the file, section and
key named.
"""

from __future__ import annotations

import configparser
from pathlib import Path
from typing import Any

from hearth.engine_args import flag_values
from hearth.errors import HearthError

EVERY_MODEL = "*"


class ModelPresets:
    def __init__(self, path: Path | None = None):
        """path: the INI file (None: no presets, every model runs with the command line's flags)."""
        self.path, self._sections = path, {}
        if path is None:
            return
        parser = configparser.ConfigParser(interpolation=None, default_section="\0")  # ([DEFAULT] is not special)
        parser.optionxform = str  # (flags keep their case: none differ by it, but a model NAME may)
        try:
            with open(path, encoding="utf-8") as f:
                parser.read_file(f)
        except (OSError, UnicodeDecodeError, configparser.Error) as e:
            raise HearthError(f"--models-preset {path}: {e}") from None
        self._sections = {name: dict(parser[name]) for name in parser.sections()}

    def model_paths(self) -> dict[str, str]:
        """The models the file itself names with `model = PATH`, by section."""
        return {name: keys["model"] for name, keys in self._sections.items() if "model" in keys}

    def check(self, names: list[str]) -> dict[str, dict[str, Any]]:
        """Every served model's engine arguments from the file (by their parsed names), checked; a section
        that names no served model is refused."""
        unknown = sorted(set(self._sections) - set(names) - {EVERY_MODEL})
        if unknown:
            raise HearthError(f"--models-preset {self.path}: [{unknown[0]}] is no model served (give it "
                              f"`model = PATH`, or --model {unknown[0]}=PATH)")
        return {name: self._engine_values(name) for name in names}

    def _engine_values(self, name: str) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for section in (EVERY_MODEL, name):
            keys = {k: v for k, v in self._sections.get(section, {}).items() if k != "model"}
            values |= flag_values(keys, f"--models-preset {self.path} [{section}]")
        return values
