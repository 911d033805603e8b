"""`.ci/run`'s EXIT trap, run alone under the script's own shell options.

The trap stops the background checks (the plugin check, ruff and mypy) when a step
fails. It must not change the exit status of a run where every check passed and the
checks' processes have already finished.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

CI_RUN = Path(__file__).resolve().parents[1] / ".ci" / "run"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _trap_line() -> str:
    lines = [ln for ln in CI_RUN.read_text().splitlines() if re.match(r"\s*trap\s", ln)]
    assert len(lines) == 1, f"expected one trap in {CI_RUN}, found {lines}"
    return lines[0]


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "harness.sh"
    log = tmp_path / "plugin.log"
    log.write_text("plugin check output\n")
    other = tmp_path / "checks.log"
    other.write_text("ruff and mypy output\n")
    head = f"set -euo pipefail\nplugin_log={log}\nchecks_log={other}\nplugin_pid=\nchecks_pid=\n"
    script.write_text(f"{head}{_trap_line()}\n{body}\n")
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30)


def test_trap_keeps_a_passing_run_green_when_the_check_has_finished(tmp_path):
    body = 'true & plugin_pid=$!\ntrue & checks_pid=$!\nwait "$plugin_pid" "$checks_pid"\nexit 0'
    result = _run(tmp_path, body)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "plugin.log").exists() and not (tmp_path / "checks.log").exists()


def test_trap_keeps_a_failing_runs_status(tmp_path):
    result = _run(tmp_path, "exit 3")
    assert result.returncode == 3


def test_trap_stops_a_running_check(tmp_path):
    marker = tmp_path / "still-running"
    body = f"true & plugin_pid=$!\nwait $plugin_pid\n(sleep 1; touch {marker}) & checks_pid=$!\nexit 1"
    result = _run(tmp_path, body)
    assert result.returncode == 1
    assert not (tmp_path / "plugin.log").exists()
    time.sleep(1.5)
    assert not marker.exists(), "the trap left the plugin check running"
