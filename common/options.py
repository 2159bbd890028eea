"""`option`: a config field that is also a command-line flag, so that the field's name, default
and help text are written once, on the dataclass (`node.cli.add_options` adds the flags to a
parser, `node.cli.options_of` builds the config back). Pure Python, imported by every config
module from the engine's up."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def option(default: Any, group: str, text: str, **flag: Any) -> Any:
    """A config field that is also a command-line flag (`cli.add_options`): --field-name
    unless flag names another, in the help group `group`. flag goes to argparse (choices,
    metavar, action; type when the default is None), except env: a variable read when the flag
    is not given (the help text then names the default itself). default MISSING: required."""
    return field(default=default, metadata={"group": group, "help": text, **flag})
