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


def _launch() -> str:
    """The prefix both background checks are started with (their own process group)."""
    found = re.findall(r"^\s*(setsid[^\n]*?)\s+(?:\.ci/example_plugin\.sh|bash -c)", CI_RUN.read_text(), re.M)
    assert len(found) == 2 and found[0] == found[1], found
    return found[0]


def test_trap_keeps_a_passing_run_green_when_the_checks_have_finished(tmp_path):
    launch = _launch()
    body = f'{launch} true & plugin_pid=$!\n{launch} true & checks_pid=$!\nwait "$plugin_pid" "$checks_pid"\nexit 0'
    result = _run(tmp_path, body)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "plugin.log").exists() and not (tmp_path / "checks.log").exists()


def test_trap_keeps_a_failing_runs_status(tmp_path):
    result = _run(tmp_path, "exit 3")
    assert result.returncode == 3


def test_trap_stops_a_running_check_and_what_it_started(tmp_path):
    # The check's shell runs `sleep` as a child of its own: the trap must stop both.
    marker = tmp_path / "still-running"
    launch = _launch()
    body = f"{launch} true & plugin_pid=$!\nwait $plugin_pid\n"
    body += f"{launch} bash -c 'sleep 1; touch {marker}' & checks_pid=$!\nsleep 0.2\nexit 1"
    result = _run(tmp_path, body)
    assert result.returncode == 1
    assert not (tmp_path / "plugin.log").exists()
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        assert not marker.exists(), "the trap left the check's child running"
        time.sleep(0.1)
