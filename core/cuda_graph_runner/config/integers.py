"""Integers from a user's text (command-line flags, ``CUDA_GRAPH_RUNNER_*`` variables):
ASCII digits only.

Python's ``int()`` also reads other scripts' digits (``int("٨") == 8``), underscores
(``int("1_0") == 10``), a sign and surrounding whitespace, so a pasted character or a
typo would silently become a number. Every parser of a count in a flag or a variable
goes through :func:`parse_digits` (or the argparse type :func:`count_arg`).

Standard library only (:mod:`cuda_graph_runner.backend.envs` and the config import it before torch).
"""

from __future__ import annotations

import argparse
import re
from typing import Callable, Optional

# [0-9], not \d: in a str pattern \d matches the digits of every script.
_DIGITS = re.compile(r"[0-9]+")


def parse_digits(text: object) -> Optional[int]:
    """The non-negative integer ``text`` spells in ASCII digits ``0-9`` (nothing else: no
    sign, space, underscore or other script's digit), else None; None too for more digits
    than ``int()`` converts (``sys.get_int_max_str_digits``)."""
    if not isinstance(text, str) or not _DIGITS.fullmatch(text):
        return None
    try:
        return int(text)
    except ValueError:  # beyond int()'s digit limit
        return None


def count_arg(minimum: int, maximum: Optional[int] = None) -> Callable[[str], int]:
    """An argparse ``type`` for a count flag: ASCII digits, at least ``minimum`` (and at
    most ``maximum`` when given).

    Raises (from the returned parser):
        argparse.ArgumentTypeError: one line naming the value and what is accepted
            (argparse prefixes the flag).
    """
    accepted = f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "") + " (digits 0-9)"

    def parse(text: str) -> int:
        value = parse_digits(text)
        if value is None or value < minimum or (maximum is not None and value > maximum):
            shown = text if len(text) <= 40 else text[:37] + "..."
            raise argparse.ArgumentTypeError(f"invalid value {shown!r}; accepted: {accepted}")
        return value

    parse.__name__ = "count"  # argparse names the type in some messages
    return parse
