"""`did you mean 'X'?`: the one hint every refusal of an unknown name gives (a config key, a
config value such as a kv_connector or a dtype, a CLI flag or a flag's choice, a model preset),
so that a misspelt `max_num_seq` says which key it was meant to be. Pure Python (the standard
library): the config and the CLI import it.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable
from typing import Any

# How close a name must be to be suggested (difflib's ratio, case folded): a letter dropped,
# doubled or swapped in a word of five or more passes; an unrelated word does not.
CUTOFF = 0.7


def did_you_mean(given: object, allowed: Iterable[object]) -> str:
    """` (did you mean 'X'?)` with X the allowed name closest to `given`, or '' when none is close.

    Case is folded for the comparison (`MoonCakeConnector` -> 'MooncakeConnector'); the suggestion
    is spelt as allowed. Only strings are compared: a number or a list given is never close.
    """
    if not isinstance(given, str) or not given:
        return ""
    by_folded: dict[str, str] = {}
    for name in allowed:
        if isinstance(name, str) and name != given:
            by_folded.setdefault(name.casefold(), name)
    close = difflib.get_close_matches(given.casefold(), list(by_folded), n=1, cutoff=CUTOFF)
    return f" (did you mean {by_folded[close[0]]!r}?)" if close else ""


class SuggestingArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose `invalid choice` refusal (a `choices=` flag, a subcommand) says
    which choice was meant, as every other refusal of an unknown name does:
    `argument --scenario: invalid choice: 'transfr' (did you mean 'transfer'?) (choose from ...)`.
    Still argparse's own error (usage, then one line, exit 2); subparsers are of this class too."""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError:
            hint = did_you_mean(value, action.choices or ())
            if not hint:
                raise
            choices = ", ".join(map(repr, action.choices or ()))
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}{hint} (choose from {choices})") from None
