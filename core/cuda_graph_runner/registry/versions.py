"""Plugin API versions: may a plugin written for API ``major.minor`` run on this core?

What it does: parses the version a ``BackendSpec`` declares with ``packaging.version``
and applies the compatibility rule as a ``packaging.specifiers`` compatible-release
clause: a plugin for ``X.Y`` runs on a core providing ``~=X.Y`` (same major, the core's
minor at least ``Y``: minors only add hooks or optional arguments).

What it does not do: look at distribution versions (a plugin's ``Requires-Dist`` range on
the core is pip's business) or decide what an incompatible plugin's entry looks like
(:mod:`.entries` lists it ``unavailable``).
"""

from __future__ import annotations

from typing import Optional

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from ..backend.hookspecs import PLUGIN_API_VERSION

CORE_DISTRIBUTION = "cuda-graph-runner"


def parse_api_version(text: object) -> Optional[Version]:
    """``text`` as a ``Version`` when it is exactly ``major.minor`` (digits only), else None.

    Stricter than PEP 440 on purpose: ``"1"``, ``"1.0.1"``, ``"1.0rc1"``, ``"v1.0"`` and
    padded text are rejected, so a declaration means one thing.
    """
    if not isinstance(text, str) or not text[:1].isdigit() or text != text.strip():
        return None
    try:
        version = Version(text)
    except InvalidVersion:
        return None
    if len(version.release) != 2 or version.epoch or str(version) != version.base_version:
        return None
    return version


def api_version_problem(declared: Optional[str]) -> Optional[str]:
    """Why a plugin declaring API ``declared`` cannot run on this core, or None if it can.

    Same major, and a minor no newer than the core's, is compatible (minors only add).
    None (undeclared) is accepted.
    """
    if declared is None:
        return None
    plugin = parse_api_version(declared)
    if plugin is None:
        return f"declares plugin API version {declared!r}, which is not of the form 'major.minor'"
    core = parse_api_version(PLUGIN_API_VERSION)
    assert core is not None, f"PLUGIN_API_VERSION {PLUGIN_API_VERSION!r} is not 'major.minor'"
    if core in SpecifierSet(f"~={plugin.major}.{plugin.minor}"):
        return None
    if plugin.major != core.major:
        return f"implements plugin API {declared}, but this core provides plugin API {PLUGIN_API_VERSION}"
    return (
        f"implements plugin API {declared}, newer than the {PLUGIN_API_VERSION} this core provides; "
        f"upgrade {CORE_DISTRIBUTION}"
    )
