"""The backend contract checker: does a class take the calls the runners make?

What it does: checks a backend class, without instantiating it, against
``BaseCudaGraphBackend`` and against :data:`RUNNER_CALLS` (every method the runners and
the registry call, with the arguments they pass), and reports every problem at once,
naming the class, the method and the parameter.

What it does not do: import a ``"module:Class"`` reference (the registry does that when
a backend is resolved or verified), run any method, or record the outcome on an entry.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Sequence, Tuple

from ..backend.errors import BackendContractError

#: How the runners and the registry call each method: (positional arguments passed,
#: keyword arguments passed). ``__init__`` is called by ``resolve``.
RUNNER_CALLS: Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...]]] = {
    "__init__": (("device",), ("phase", "phase_config")),
    "set_capture_plan": (("plan",), ()),
    "prepare": (("plan",), ()),
    "capture_session": (("stream",), ()),
    "capture_one": (("key", "forward_fn"), ("post_warmup_hook",)),
    "can_run": (("batch", "key"), ()),
    "replay_session": ((), ()),
    "replay": (("key", "static_batch"), ()),
    "cleanup": ((), ()),
    "discard": (("key",), ()),
    "graph_memory_bytes": ((), ()),
}
_CONTEXT_MANAGER_METHODS = ("capture_session", "replay_session")


def check_backend_class(cls: Any, name: str = "?") -> None:
    """Check that ``cls`` honours the backend contract the runners rely on: a subclass
    of ``BaseCudaGraphBackend`` implementing every abstract method, each method taking
    the arguments the runners pass (:data:`RUNNER_CALLS`) and requiring no others,
    plain methods (not static, class or async), and the two session methods returning
    context managers rather than bare generators.

    Raises:
        BackendContractError: naming the class, the method and what is wrong (every
            problem found, ``; ``-separated; also in its ``problems`` attribute).
    """
    from ..backend.base import BaseCudaGraphBackend  # imports torch: only when a class is checked

    qual = f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls)!s}"
    if not (isinstance(cls, type) and issubclass(cls, BaseCudaGraphBackend)):
        raise BackendContractError(f"backend {name!r}: {qual} is not a subclass of BaseCudaGraphBackend")
    problems: List[str] = []
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        problems.append(f"{qual} does not implement {', '.join(missing)}")
    # A narrower signature would fail only at capture, deep inside a run, so every call
    # the runners make is checked up front.
    for method, (positional, keywords) in RUNNER_CALLS.items():
        if method in missing:
            continue
        problems.extend(_method_problems(cls, qual, method, positional, keywords))
    if problems:
        err = BackendContractError(f"backend {name!r} breaks the backend contract: " + "; ".join(problems))
        err.problems = problems  # type: ignore[attr-defined]
        raise err


def _method_problems(
    cls: type, qual: str, method: str, positional: Sequence[str], keywords: Sequence[str]
) -> List[str]:
    where = f"{qual}.{method}"
    raw = inspect.getattr_static(cls, method, None)
    if isinstance(raw, (staticmethod, classmethod)):
        return [f"{where} is a {type(raw).__name__}; the runners call it on the instance, make it a plain method"]
    func = getattr(cls, method, None)
    if not callable(func):
        return [f"{where} is not callable"]
    if inspect.iscoroutinefunction(func):
        return [f"{where} is async; the runners call it synchronously"]
    if method in _CONTEXT_MANAGER_METHODS and inspect.isgeneratorfunction(func):
        return [
            f"{where} is a bare generator; decorate it with @contextlib.contextmanager (the runners use it in 'with')"
        ]
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return []  # a builtin without a signature: nothing to check
    params = list(sig.parameters.values())
    if params and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        params = params[1:]  # self
    where = f"{where}{sig}"
    has_var_pos = any(p.kind is p.VAR_POSITIONAL for p in params)
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    pos_params = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    problems = []
    if len(pos_params) < len(positional) and not has_var_pos:
        problems.append(
            f"{where} takes {len(pos_params)} positional argument(s); the runners pass "
            f"{len(positional)} ({', '.join(positional)})"
        )
    consumed = pos_params[: len(positional)]
    for kw in keywords:
        p = sig.parameters.get(kw)
        if p is not None and p in consumed:
            problems.append(
                f"{where} takes {kw!r} as positional argument {consumed.index(p) + 1}, where the runners "
                f"pass {positional[consumed.index(p)]!r}; the runners pass {kw!r} by keyword"
            )
        elif (p is None or p.kind is p.POSITIONAL_ONLY) and not has_var_kw:
            problems.append(f"{where} lacks keyword parameter {kw!r}, which the runners pass")
    extra = [
        p.name
        for p in params
        if p not in consumed
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and p.default is p.empty
        and p.name not in keywords
    ]
    if extra:
        problems.append(f"{where} requires extra parameter(s) {extra} the runners never pass")
    return problems
