"""Helpers for testing plugin *packaging*: a throwaway distribution installed into a
private directory, a fresh interpreter that sees it, a picklable registry listing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ... import registry
from ...backend.hookspecs import ENTRY_POINT_GROUP


def registry_snapshot(device_type: Optional[str] = "cpu") -> List[Dict[str, str]]:
    """``list_backends(device_type)`` as plain rows (``BackendEntry.as_row``), plus the
    process id: picklable, so a multiprocessing child can report what it discovered."""
    return [dict(e.as_row(), pid=str(os.getpid())) for e in registry.list_backends(device_type)]


def write_plugin_source(
    directory: Path,
    dist_name: str,
    modules: Mapping[str, str],
    entry_points: Mapping[str, str],
    *,
    version: str = "0.0.1",
) -> Path:
    """Write a minimal plugin distribution (one-file modules) to ``directory``.

    Args:
        dist_name: distribution name (``"acme-broken"``).
        modules: ``{module_name: source}``; sources are dedented.
        entry_points: ``{backend_name: "module[:attr]"}`` in group ``cuda_graph_runner.backends``.

    Returns:
        ``directory``, ready for ``pip install``.
    """
    directory.mkdir(parents=True, exist_ok=True)
    for name, source in modules.items():
        (directory / f"{name}.py").write_text(textwrap.dedent(source))
    eps = "\n".join(f'{name} = "{value}"' for name, value in entry_points.items())
    (directory / "pyproject.toml").write_text(
        "[build-system]\n"
        'requires = ["setuptools>=68"]\n'
        'build-backend = "setuptools.build_meta"\n'
        "[project]\n"
        f'name = "{dist_name}"\n'
        f'version = "{version}"\n'
        f'[project.entry-points."{ENTRY_POINT_GROUP}"]\n'
        f"{eps}\n"
        "[tool.setuptools]\n"
        f"py-modules = {json.dumps(sorted(modules))}\n"
    )
    return directory


def install_plugin_distributions(site: Path, *sources: Path) -> Path:
    """``pip install`` plugin source trees into the private directory ``site`` (``--target``),
    offline and without build isolation; put ``site`` on ``PYTHONPATH`` to see them.

    Raises:
        subprocess.CalledProcessError: pip failed (its output is in the exception).
    """
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(site),
            *map(str, sources),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return site


def run_python(
    code: str, *, pythonpath: Sequence[Any] = (), env: Optional[Mapping[str, str]] = None, expect_ok: bool = True
) -> Dict[str, Any]:
    """Run ``code`` in a fresh interpreter; return the JSON object on its last stdout line.

    Args:
        pythonpath: directories prepended to ``PYTHONPATH``.
        env: extra environment variables (a value of ``None`` is not allowed; to unset
            use an empty string where the variable allows it).
        expect_ok: assert a zero exit status. When False, returns ``{"returncode",
            "stdout", "stderr"}`` and never parses.
    """
    full_env = dict(os.environ)
    full_env.update(env or {})
    paths = [str(p) for p in pythonpath if p]
    if paths:
        full_env["PYTHONPATH"] = os.pathsep.join(
            paths + ([full_env["PYTHONPATH"]] if full_env.get("PYTHONPATH") else [])
        )
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True, text=True)
    if not expect_ok:
        return {"returncode": out.returncode, "stdout": out.stdout, "stderr": out.stderr}
    assert out.returncode == 0, f"subprocess failed ({out.returncode}):\n{out.stderr[-4000:]}"
    lines = out.stdout.strip().splitlines()
    assert lines, f"subprocess printed nothing; stderr:\n{out.stderr[-4000:]}"
    return json.loads(lines[-1])
