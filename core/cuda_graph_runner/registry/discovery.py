"""Entry-point discovery: which plugins are installed, and importing the one asked for.

What it does: reads the entry-point group (one distribution at a time when importlib's
walk over all of them breaks), applies the autoload switches of :mod:`cuda_graph_runner.backend.envs`
(``CUDA_GRAPH_RUNNER_DISABLE_PLUGIN_AUTOLOAD``, ``CUDA_GRAPH_RUNNER_PLUGINS``), names each
entry point's distribution even when its METADATA is incomplete, and imports an entry
point or a ``"module:attr"`` reference with an error that says which part failed.

What it does not do: register anything with pluggy, keep state, or decide what a
failure means for the other plugins (:mod:`.manager` does); it never imports backend
classes on its own.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from packaging.utils import canonicalize_name

from ..backend import envs
from ..backend.errors import BackendLoadError

ENV_PLUGINS = envs.PLUGINS
ENV_DISABLE_AUTOLOAD = envs.DISABLE_PLUGIN_AUTOLOAD

#: ``{entry-point name: (distribution, why it was not loaded)}``.
Skipped = Dict[str, Tuple[str, str]]


def one_line(exc: BaseException) -> str:
    """``"TypeName: first line of the message"``, for reasons shown in one table cell."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def normalize_dist(name: str) -> str:
    """PEP 503 normalisation, so ``"Acme_Backend"`` and ``"acme-backend"`` are one distribution."""
    return canonicalize_name(name)


def read_environment() -> Dict[str, Any]:
    """The scan's environment variables, parsed by :mod:`cuda_graph_runner.backend.envs`.

    Raises:
        envs.EnvVarError: a value does not parse (names variable, value, accepted values).
    """
    return {
        "autoload_off": envs.get(ENV_DISABLE_AUTOLOAD),
        "plugins": envs.get(ENV_PLUGINS),
        "plugins_text": envs.raw(ENV_PLUGINS),
        "prefer": envs.get(envs.PREFER),
    }


def all_entry_points(group: str, problem: Callable[[str], None]) -> List[metadata.EntryPoint]:
    """Every installed entry point of ``group``; ``problem(message)`` hears what could not be read."""
    try:
        return list(metadata.entry_points(group=group))
    except Exception as exc:
        # A malformed distribution can break importlib's walk over all of them:
        # read the distributions one by one so it hides no other plugin.
        problem(f"importlib.metadata.entry_points() raised {one_line(exc)}; reading installed distributions one by one")
    eps: List[metadata.EntryPoint] = []
    for dist in metadata.distributions():
        try:
            eps.extend(ep for ep in dist.entry_points if ep.group == group)
        except Exception as exc:
            problem(f"cannot read the entry points of {dist_label(dist)}: {one_line(exc)}")
    return eps


def select_entry_points(
    eps: List[metadata.EntryPoint],
    env: Mapping[str, Any],
    *,
    autoload: bool,
    skipped: Skipped,
    problem: Optional[Callable[[str], None]] = None,
) -> List[metadata.EntryPoint]:
    """The entry points to load under the autoload switches; the others go to ``skipped``
    (so an unknown-name error can say the plugin is installed but was not loaded).

    ``problem(message)`` hears each name in ``CUDA_GRAPH_RUNNER_PLUGINS`` that matches no
    installed entry point or distribution (a typo would otherwise load nothing, silently).
    """
    if not autoload or env["autoload_off"]:
        why = (
            f"plugin autoload is off ({ENV_DISABLE_AUTOLOAD}=1)"
            if autoload
            else "plugin autoload is off (BackendRegistry(autoload=False))"
        )
        for ep in eps:
            skipped.setdefault(ep.name, (ep_dist(ep)[0], why))
        return []
    if env["plugins"] is None:
        return eps
    names = set(env["plugins"])
    normalized = {normalize_dist(n) for n in names}
    kept = []
    for ep in eps:
        if ep.name in names or normalize_dist(ep_dist(ep)[0]) in normalized:
            kept.append(ep)
        else:
            skipped.setdefault(ep.name, (ep_dist(ep)[0], f"{ENV_PLUGINS}={env['plugins_text']!r} does not list it"))
    if problem is not None:
        known = {ep.name for ep in eps} | {normalize_dist(ep_dist(ep)[0]) for ep in eps}
        unmatched = sorted(n for n in names if n not in known and normalize_dist(n) not in known)
        if unmatched:
            installed = sorted({ep.name for ep in eps})
            problem(
                f"{ENV_PLUGINS}={env['plugins_text']!r}: {', '.join(map(repr, unmatched))} "
                f"matches no installed backend or distribution; installed backends: {installed}"
            )
    return kept


def load_entry_point(ep: metadata.EntryPoint, dist_name: str, version: str) -> Any:
    """``ep.load()``, with a message that says which part failed.

    Not ``ep.load()`` itself: its error does not say whether the import or the attribute
    failed, and a lazy module ``__getattr__`` may raise anything.

    Raises:
        BackendLoadError: the module does not import (``SystemExit`` included), or lacks
            the attribute the entry point names; the original exception is chained.
        KeyboardInterrupt: passed through.
    """
    where = f"entry point {ep.name} = {ep.value!r} of {dist_name} {version}"
    module_name, _, attr_path = ep.value.partition(":")
    module_name, attr_path = module_name.strip(), attr_path.split("[")[0].strip()
    try:
        obj: Any = importlib.import_module(module_name)
    except BaseException as exc:  # a broken plugin must not break the others, even SystemExit
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise BackendLoadError(f"{where}: import of module {module_name!r} failed: {one_line(exc)}") from exc
    for part in attr_path.split(".") if attr_path else ():
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise BackendLoadError(f"{where}: module {module_name!r} has no attribute {attr_path!r}") from exc
        except BaseException as exc:  # a lazy module __getattr__ may raise anything (ImportError)
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise BackendLoadError(
                f"{where}: getting attribute {attr_path!r} of module {module_name!r} raised {one_line(exc)}"
            ) from exc
    return obj


def load_ref(ref: Union[str, Any]) -> Any:
    """Import ``"module:attr.path"``; objects pass through.

    Raises:
        ValueError: ``ref`` is not of that form.
        ImportError: the module does not import.
        AttributeError: the module lacks the attribute (the message names both).
    """
    if not isinstance(ref, str):
        return ref
    module_name, sep, attr_path = ref.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"reference {ref!r} is not of the form 'package.module:attribute'")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise AttributeError(f"{module_name!r} has no attribute {attr_path!r} ({exc})") from exc
    return obj


def ref_name(ref: Any) -> str:
    """How a reference is named in messages: the string, or the object's qualified name."""
    return ref if isinstance(ref, str) else getattr(ref, "__qualname__", repr(ref))


def ep_dist(ep: metadata.EntryPoint) -> Tuple[str, str]:
    """(distribution name, version) of ``ep``; placeholders where its METADATA lacks them
    (a METADATA without ``Name`` gives None, or raises on newer Pythons)."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "<unknown>", "?"
    return dist_label(dist), _metadata_field(dist, "Version") or "?"


def _metadata_field(dist: Any, field: str) -> Optional[str]:
    try:
        value = dist.metadata[field]
    except Exception:
        return None
    return value.strip() if isinstance(value, str) and value.strip() else None


def dist_label(dist: Any) -> str:
    """The distribution's name, or ``<unnamed distribution at PATH>`` without one."""
    name = _metadata_field(dist, "Name")
    if name is not None:
        return name
    where = getattr(dist, "_path", None)  # importlib's PathDistribution: the .dist-info folder
    return f"<unnamed distribution at {where}>" if where is not None else "<unnamed distribution>"


def dist_version(name: str) -> str:
    """The installed version of distribution ``name``, or ``"?"``."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "?"
