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
pass, one capture, one replay) uses :func:`forward_replaced` instead: the same
dispatcher, with the block's forward seen by the block's thread only.

What the dispatcher keeps true, whatever sequence of runners and backends one model
sees (several at once, cleaned up and made again, from several threads):

* a ``forward_replaced`` block is seen by its own thread only, and the model's forward
  comes back when the last block and the last wrapper are gone, in whatever order the
  threads end them;
* Dynamo never traces the dispatch (which reads thread-local state and weak references
  it cannot trace): a ``torch.compile`` reaching the dispatcher compiles the model's
  forward as written, and backends compile :func:`forward_as_written` directly.

Borrowed from sglang's ``install_torch_compiled`` (a compiled forward installed on the
model, dispatched by a context flag), made owner-aware, thread-aware and reversible.
"""

from __future__ import annotations

import contextlib
import threading
import types
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

#: Serializes installing and removing dispatchers, and their wrapper lists and block counts.
_LOCK = threading.Lock()

#: False when run, True when Dynamo traces it (PyTorch's ``is_dynamo_compiling``; unlike
#: ``is_compiling``, never True in a thread that merely runs while another compiles).
_dynamo_tracing: Callable[[], bool] = getattr(torch.compiler, "is_dynamo_compiling", lambda: False)


class _Dispatch:
    """The dispatcher installed as one model's ``forward``, shared by every wrapper and
    block on it: the innermost block of the calling thread, else the first active
    wrapper, else the original forward."""

    def __init__(self, model: Any) -> None:
        self.had_instance_forward = "forward" in getattr(model, "__dict__", {})
        self.original: Callable[..., Any] = model.forward
        self.__wrapped__ = self.original  # inspect.signature shows the model's own
        # Replaced as a whole (never changed in place): a call in another thread iterates
        # a consistent tuple.
        self.wrappers: Tuple["ForwardWrapper", ...] = ()
        #: forward_replaced blocks open now, all threads together.
        self.blocks = 0
        #: Per thread: ``stack``, the forwards of that thread's open blocks (innermost last).
        self.local = threading.local()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not _dynamo_tracing():
            stack = getattr(self.local, "stack", None)
            if stack:
                return stack[-1](*args, **kwargs)
            for wrapper in self.wrappers:
                if wrapper.is_active():
                    return wrapper(*args, **kwargs)
        return self.original(*args, **kwargs)

    def __reduce__(self) -> Tuple[Any, ...]:
        # A pickled model (torch.save, or Dynamo saving a compiled forward's guards, which
        # reach the model through its bound forward) keeps its forward as written; the
        # thread-local state and weakly held backends are this process's only.
        return (_same, (self.original,))


def _same(value: Any) -> Any:
    return value


def _installed(model: Any) -> Optional[_Dispatch]:
    forward = getattr(model, "__dict__", {}).get("forward")
    return forward if isinstance(forward, _Dispatch) else None


def _install(model: Any) -> _Dispatch:
    """The model's dispatcher, installed as its ``forward`` if it has none (under ``_LOCK``)."""
    dispatch = _installed(model)
    if dispatch is None:
        dispatch = model.__dict__["forward"] = _Dispatch(model)
    return dispatch


def _release(model: Any, dispatch: _Dispatch) -> None:
    """Give ``model`` its forward back once nothing uses ``dispatch`` (under ``_LOCK``)."""
    if dispatch.wrappers or dispatch.blocks or model is None or _installed(model) is not dispatch:
        return
    if dispatch.had_instance_forward:
        model.__dict__["forward"] = dispatch.original
    else:
        model.__dict__.pop("forward", None)


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
        """Stop standing in; the last wrapper removed (with no ``forward_replaced`` block
        open) restores the model's forward."""
        with _LOCK:
            dispatch = self._dispatch
            dispatch.wrappers = tuple(w for w in dispatch.wrappers if w is not self)
            _release(self._model(), dispatch)


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
    with _LOCK:
        dispatch = _install(model)
        wrapper = ForwardWrapper(model, dispatch, forward, active)
        dispatch.wrappers = (*dispatch.wrappers, wrapper)
    return wrapper


def forward_wrappers(model: Any) -> List[ForwardWrapper]:
    """The wrappers installed on ``model`` (empty when its forward is its own)."""
    dispatch = _installed(model)
    return list(dispatch.wrappers) if dispatch is not None else []


def forward_as_written(model: Any) -> Callable[..., Any]:
    """``model``'s forward beneath any dispatcher: what a backend compiles or captures.

    ``model.forward`` itself may be the dispatcher (another backend on the model wrapped
    it, or a block of :func:`forward_replaced` is open), which a backend must never
    compile: Dynamo cannot trace its thread-local dispatch, and compiling it would make
    one backend's code call another's.
    """
    dispatch = _installed(model)
    return dispatch.original if dispatch is not None else model.forward


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
    """In this thread, ``model.forward(...)`` runs ``forward`` for the block; then the
    model's forward is exactly what it was before.

    For a backend that runs its own forward only inside a block it controls (a compile
    pass, one capture, one replay). The block installs the model's dispatcher
    (:func:`wrap_model_forward`'s) if it has none; the block's ``forward`` wins over any
    wrapper, inner blocks over outer ones. Other threads keep seeing the model's forward
    (or their own blocks' forwards), so two runners of one model may capture or replay
    from two threads; the dispatcher goes when the last block and wrapper end, in
    whatever order. ``forward`` should call :func:`forward_as_written`'s forward, never
    ``model.forward`` (that is the dispatcher again).

    Raises:
        TypeError: ``model`` has no instance ``__dict__``; ``forward`` is not callable.
    """
    attrs = getattr(model, "__dict__", None)
    if attrs is None:
        raise TypeError(f"cannot replace the forward of {type(model).__name__} object: it has no instance __dict__")
    if not callable(forward):
        raise TypeError(f"forward_replaced: forward must be callable, got {forward!r}")
    with _LOCK:
        dispatch = _install(model)
        dispatch.blocks += 1
    stack = getattr(dispatch.local, "stack", None)
    if stack is None:
        stack = dispatch.local.stack = []
    stack.append(forward)
    try:
        yield
    finally:
        # This block's entry: the last one equal to it (blocks of one thread end innermost first).
        for index in range(len(stack) - 1, -1, -1):
            if stack[index] is forward:
                del stack[index]
                break
        with _LOCK:
            dispatch.blocks -= 1
            _release(model, dispatch)
