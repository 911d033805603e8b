"""How a backend replaces a model's forward (plugin API 1.1): for good, or for a block.

A backend that runs its own version of the forward (tc_piecewise: ``torch.compile``
split at the marked ops) needs the runner's ``model.forward(batch)`` calls to reach it
during capture and replay, and nothing else to change: the runner's eager fallback,
another backend on the same model and the user's own calls must run the model as
written. :func:`wrap_model_forward` (reached by backends through
``CapturePlan.wrap_model_forward``) installs one dispatcher per model as the instance's
``forward``; each wrapper says when it is active; the first active wrapper's forward
runs, else the original. Removing the last wrapper gives the model its original
forward back (the class's, or the instance attribute it had). Wrappers keep their
backend only weakly: dropping a runner frees its backend even while the model lives.
A backend that runs its own forward only inside a block it runs itself (a compile
pass, one capture, one replay) uses :func:`forward_replaced` instead.

Borrowed from sglang's ``install_torch_compiled`` (a compiled forward installed on the
model, dispatched by a context flag), made owner-aware and reversible.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional

_ATTR = "_cuda_graph_runner_forward_dispatch"


class _Dispatch:
    """The dispatcher installed on one model, shared by every wrapper on it."""

    def __init__(self, model: Any) -> None:
        self.had_instance_forward = "forward" in getattr(model, "__dict__", {})
        self.original: Callable[..., Any] = model.forward
        self.wrappers: List["ForwardWrapper"] = []


def _weak(fn: Callable[..., Any]) -> Callable[[], Optional[Callable[..., Any]]]:
    if hasattr(fn, "__self__") and hasattr(fn, "__func__"):
        return weakref.WeakMethod(fn)
    return lambda: fn


class ForwardWrapper:
    """One backend's stand-in for a model's forward (see :func:`wrap_model_forward`).

    Attributes:
        original: the model's forward as it was before the first wrapper.
    """

    def __init__(self, model: Any, dispatch: _Dispatch, forward: Callable[..., Any], active: Callable[[], bool]):
        self._model = weakref.ref(model) if _weakrefable(model) else (lambda: model)
        self._dispatch = dispatch
        self._forward = _weak(forward)
        self._active = _weak(active)

    @property
    def original(self) -> Callable[..., Any]:
        return self._dispatch.original

    @property
    def shared_with(self) -> List["ForwardWrapper"]:
        """Every wrapper installed on the same model (this one included)."""
        return list(self._dispatch.wrappers)

    def is_active(self) -> bool:
        active = self._active()
        return active is not None and self._forward() is not None and bool(active())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self._forward()
        if forward is None:
            raise RuntimeError("the backend that wrapped this model's forward was garbage collected")
        return forward(*args, **kwargs)

    def remove(self) -> None:
        """Stop standing in; the last wrapper removed restores the model's forward."""
        wrappers = self._dispatch.wrappers
        if self in wrappers:
            wrappers.remove(self)
        model = self._model()
        if not wrappers and model is not None and model.__dict__.get(_ATTR) is self._dispatch:
            del model.__dict__[_ATTR]
            if self._dispatch.had_instance_forward:
                model.__dict__["forward"] = self._dispatch.original
            else:
                model.__dict__.pop("forward", None)


def _weakrefable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


def wrap_model_forward(model: Any, forward: Callable[..., Any], *, active: Callable[[], bool]) -> ForwardWrapper:
    """Make ``forward`` stand in for ``model.forward`` while ``active()`` is true.

    Args:
        model: any object with a ``forward`` and an instance ``__dict__`` (an
            ``nn.Module``).
        forward: takes what ``model.forward`` takes and returns what it returns; a bound
            method is kept weakly (its object's lifetime is its owner's business).
        active: called on every ``model.forward`` call; cheap (a thread-local read).

    Returns:
        The :class:`ForwardWrapper`; call ``remove()`` when the backend is done.

    Raises:
        TypeError: ``model`` has no instance ``__dict__`` to install the dispatcher in.
    """
    if not hasattr(model, "__dict__"):
        raise TypeError(f"cannot wrap the forward of a {type(model).__name__}: it has no instance __dict__")
    dispatch = model.__dict__.get(_ATTR)
    if dispatch is None:
        dispatch = _Dispatch(model)
        original = dispatch.original
        wrappers = dispatch.wrappers

        def dispatched_forward(*args: Any, **kwargs: Any) -> Any:
            for wrapper in wrappers:
                if wrapper.is_active():
                    return wrapper(*args, **kwargs)
            return original(*args, **kwargs)

        dispatched_forward.__wrapped__ = original  # type: ignore[attr-defined]
        model.__dict__[_ATTR] = dispatch
        model.__dict__["forward"] = dispatched_forward
    wrapper = ForwardWrapper(model, dispatch, forward, active)
    dispatch.wrappers.append(wrapper)
    return wrapper


def forward_wrappers(model: Any) -> List[ForwardWrapper]:
    """The wrappers installed on ``model`` (empty when its forward is its own)."""
    dispatch = getattr(model, "__dict__", {}).get(_ATTR)
    return list(dispatch.wrappers) if dispatch is not None else []


def entry_function(original: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``lambda *a, **k: original(*a, **k)`` with a code object of its own, named ``name``
    (``:`` and ``-`` become ``_``), for ``torch.compile`` to compile.

    Dynamo keeps its cache, and its recompile limit, per code object: a code object per
    backend (tc_piecewise, compiled ``full``) or per size bucket (``compiled``) keeps two
    compilations of one model's forward from sharing, or evicting, each other's entries.
    """

    def forward(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    code = forward.__code__
    name = name.replace(":", "_").replace("-", "_")
    changes: Dict[str, Any] = {"co_name": name}
    if hasattr(code, "co_qualname"):
        changes["co_qualname"] = name
    return types.FunctionType(code.replace(**changes), forward.__globals__, name, None, forward.__closure__)


@contextlib.contextmanager
def forward_replaced(model: Any, forward: Callable[..., Any]) -> Iterator[None]:
    """``model.forward`` is ``forward`` for the block, then exactly what it was before.

    For a backend that runs its own forward only inside a block it controls (a compile
    pass, one capture, one replay): an instance attribute shadows the class's method
    (and any dispatcher :func:`wrap_model_forward` installed) and is removed afterwards,
    or the instance attribute the model had is put back. Not reentrant across threads:
    another thread calling ``model.forward`` meanwhile runs ``forward`` too; a backend
    whose forward must stay installed between calls uses :func:`wrap_model_forward`.

    Raises:
        TypeError: ``model`` has no instance ``__dict__``; ``forward`` is not callable.
    """
    attrs = getattr(model, "__dict__", None)
    if attrs is None:
        raise TypeError(f"cannot replace the forward of {type(model).__name__} object: it has no instance __dict__")
    if not callable(forward):
        raise TypeError(f"forward_replaced: forward must be callable, got {forward!r}")
    had, before = "forward" in attrs, attrs.get("forward")
    attrs["forward"] = forward
    try:
        yield
    finally:
        if had:
            attrs["forward"] = before
        else:
            attrs.pop("forward", None)
