"""Plugin API versions: may a plugin written for API ``major.minor`` run on this core?

What it does: parses the version a ``BackendSpec`` declares with ``packaging.version``
and applies the compatibility rule as a ``packaging.specifiers`` compatible-release
clause: a plugin for ``X.Y`` runs on a core providing ``~=X.Y`` (same major, the core's
minor at least ``Y``: minors only add hooks or optional arguments), from
:data:`OLDEST_PLUGIN_API_VERSION` on: a plugin for an older minor is told what it must
add to reach that version (:data:`TO_REACH_OLDEST`).

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
#: The oldest plugin API this core runs (same major as ``PLUGIN_API_VERSION``).
OLDEST_PLUGIN_API_VERSION = "1.1"
#: What a plugin written for an older minor must add to be :data:`OLDEST_PLUGIN_API_VERSION`.
TO_REACH_OLDEST = {
    "1.0": (
        "to be 1.1, take the capture plan in prepare(plan) (plan.keys, plan.static_batch(key), "
        "plan.forward(batch), plan.wrap_model_forward(...)) instead of reading the runner's "
        "capture_sizes, capture_prepare, make_key or graph_forward, and declare api_version='1.1' "
        "(docs/plugin-authors.md §3, what a backend gets at capture)"
    ),
}


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

    Same major, and a minor from :data:`OLDEST_PLUGIN_API_VERSION` to the core's, is
    compatible (minors only add). None (undeclared) is accepted.
    """
    if declared is None:
        return None
    plugin = parse_api_version(declared)
    if plugin is None:
        return f"declares plugin API version {declared!r}, which is not of the form 'major.minor'"
    core = parse_api_version(PLUGIN_API_VERSION)
    assert core is not None, f"PLUGIN_API_VERSION {PLUGIN_API_VERSION!r} is not 'major.minor'"
    oldest = parse_api_version(OLDEST_PLUGIN_API_VERSION)
    assert oldest is not None and oldest.major == core.major, f"OLDEST_PLUGIN_API_VERSION {OLDEST_PLUGIN_API_VERSION!r}"
    if plugin.major == oldest.major and plugin < oldest:
        what = TO_REACH_OLDEST.get(
            f"{plugin.major}.{plugin.minor}",
            f"see docs/plugin-authors.md for the API {OLDEST_PLUGIN_API_VERSION} contract",
        )
        return (
            f"implements plugin API {declared}, older than the {OLDEST_PLUGIN_API_VERSION} to "
            f"{PLUGIN_API_VERSION} this core runs; {what}"
        )
    if core in SpecifierSet(f"~={plugin.major}.{plugin.minor}"):
        return None
    if plugin.major != core.major:
        return f"implements plugin API {declared}, but this core provides plugin API {PLUGIN_API_VERSION}"
    return (
        f"implements plugin API {declared}, newer than the {PLUGIN_API_VERSION} this core provides; "
        f"upgrade {CORE_DISTRIBUTION}"
    )
