"""Logging and warning set-up of the ``cuda-graph-runner`` command.

``-v`` shows INFO records (the runner's one line per captured graph, "captured decode
graph K with B in S s", and its summary per capture, "captured N decode graphs with B in
S s (H graphs held, graph memory M MiB)"), ``-vv`` DEBUG records,
``--log-level NAME`` sets the level by name (it wins over ``-v``). Only the records of
cuda-graph-runner and of its installed backend plugins go below WARNING: a DEBUG run
does not flood the terminal with torch's or another library's debug output. Records go
to stderr, so the JSON or CSV of ``--format`` on stdout stays parseable.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from typing import Iterable, Optional, Set, TextIO

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
_HANDLER_NAME = "cuda-graph-runner-cli"


def hide_third_party_noise() -> None:
    """Hide torch's "Failed to initialize NumPy" warning: torch emits it at import when
    numpy is absent, which is normal for us (numpy is not a dependency), so every CLI call
    in a venv without numpy would start with a confusing warning."""
    warnings.filterwarnings("ignore", message=r"Failed to initialize NumPy", category=UserWarning)


def _level_name(text: str) -> str:
    name = text.upper()
    if name not in LEVELS:
        raise argparse.ArgumentTypeError(f"invalid level {text!r}; accepted: {', '.join(LEVELS)} (any case)")
    return name


def add_logging_arguments(parser: argparse.ArgumentParser, *, in_subcommand: bool = False) -> None:
    """``-v/--verbose`` (repeatable) and ``--log-level`` on ``parser``.

    On a subcommand the defaults are suppressed, so ``cuda-graph-runner -v bench`` and
    ``cuda-graph-runner bench -v`` both work and one never resets the other.
    """
    default = argparse.SUPPRESS if in_subcommand else None
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=argparse.SUPPRESS if in_subcommand else 0,
        help="more log output on stderr: -v INFO (e.g. capture times), -vv DEBUG",
    )
    parser.add_argument(
        "--log-level",
        type=_level_name,
        default=default,
        metavar="LEVEL",
        help=f"log level by name, one of {', '.join(LEVELS)} (overrides -v; default WARNING)",
    )


def level_from_args(args: argparse.Namespace) -> int:
    """The logging level ``args`` ask for (``--log-level`` wins over ``-v``)."""
    name = getattr(args, "log_level", None)
    if name:
        return getattr(logging, name)
    verbose = getattr(args, "verbose", 0) or 0
    return logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG


def plugin_logger_roots() -> Set[str]:
    """Top-level package names of the installed backend plugins (from their entry points),
    plus the core's: the loggers ``-v`` opens up."""
    from importlib import metadata

    roots = {"cuda_graph_runner"}
    try:
        for ep in metadata.entry_points(group="cuda_graph_runner.backends"):
            roots.add(ep.value.split(":")[0].split(".")[0])
    except Exception:  # a broken distribution's metadata must not break logging set-up
        pass
    return roots


class _OursOrWarning(logging.Filter):
    """Pass records of our loggers at the chosen level, everyone else's from WARNING."""

    def __init__(self, roots: Iterable[str], level: int) -> None:
        super().__init__()
        self.roots = tuple(roots)
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= max(self.level, logging.WARNING):
            return True
        ours = any(record.name == r or record.name.startswith(r + ".") for r in self.roots)
        return ours and record.levelno >= self.level


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at each record (a test's capture, a redirect),
    not to the stream of the moment the handler was made, which may be closed since."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def configure_logging(level: int, *, stream: Optional[TextIO] = None, roots: Optional[Iterable[str]] = None) -> None:
    """Send log records to ``stream`` (default stderr) at ``level`` for our loggers.

    Idempotent: a second call replaces the handler this function installed (tests call
    ``main`` many times in one process).
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        if handler.get_name() == _HANDLER_NAME:
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream) if stream is not None else _CurrentStderrHandler()
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.addFilter(_OursOrWarning(plugin_logger_roots() if roots is None else roots, level))
    root.addHandler(handler)
    root.setLevel(min(level, logging.WARNING))
