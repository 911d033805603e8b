"""Reading a config document: JSON given as text or as the path of a file.

Duplicate object keys are an error (``json`` would keep the last one silently); a UTF-8
byte-order mark is accepted. Standard library only.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple

from .exceptions import CudaGraphConfigError


def _reject_duplicates(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    # json keeps the last duplicate silently; a config that says two things is an error.
    out: Dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise CudaGraphConfigError("duplicate key in a JSON object", value=key, accepted="each key once")
        out[key] = value
    return out


def _names_a_file(text: str) -> bool:
    """Whether ``text`` reads as a file's path rather than JSON: one line ending in ``.json``."""
    stripped = text.strip()
    return stripped.lower().endswith(".json") and "\n" not in stripped and not stripped.startswith(("{", "[", '"'))


def _load_json(text_or_path: Any, source: Optional[str]) -> Any:
    """The JSON value in ``text_or_path`` (JSON text, or a path to a file). Raises CudaGraphConfigError."""
    accepted = 'a JSON object such as \'{"decode": {"backend": "full"}}\' or the path of a file holding one'
    path = None
    if isinstance(text_or_path, os.PathLike):
        path = os.fspath(text_or_path)
    elif not isinstance(text_or_path, str):
        raise CudaGraphConfigError("must be JSON text or a path", value=text_or_path, accepted=accepted, source=source)
    elif not text_or_path.lstrip().startswith(("{", "[")):
        expanded = os.path.expanduser(text_or_path.strip())
        if os.path.isfile(expanded):
            path = expanded
        elif _names_a_file(text_or_path):  # a typo'd path: say so, not that it is bad JSON
            where = os.path.abspath(expanded)
            problem = "is a directory, not a file" if os.path.isdir(expanded) else f"no such file ({where})"
            raise CudaGraphConfigError(problem, value=text_or_path, accepted=accepted, source=source)
    text = text_or_path
    if path is not None:
        try:
            # utf-8-sig: editors on Windows save JSON with a byte-order mark; accept it.
            with open(path, encoding="utf-8-sig") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as err:
            raise CudaGraphConfigError(
                f"cannot read the file ({err})", value=text_or_path, accepted=accepted, source=source
            ) from None
    if text.startswith("\ufeff"):  # a BOM kept in text read by the caller
        text = text[1:]
    try:
        return json.loads(text, object_pairs_hook=_reject_duplicates)
    except CudaGraphConfigError as err:
        raise err.with_context(source=source) from None
    except RecursionError:
        problem = "JSON nested too deeply"
    except ValueError as err:  # JSONDecodeError, and int() digit limits
        problem = f"not valid JSON ({err})"
    if path is None:
        problem += " and not an existing file"
    else:
        problem += f" in file {path!r}"
    raise CudaGraphConfigError(problem, value=text_or_path, accepted=accepted, source=source)
