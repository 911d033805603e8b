"""Backends' availability probes: bounded in time (a slow one is listed as timed out, the
others still listed), answered once per process and device type, True accepted as usable,
and the time limit's settings checked (environment variable and registry argument)."""

from __future__ import annotations

import json
import threading

import pytest

from cuda_graph_runner import registry
from cuda_graph_runner.backend import envs
from cuda_graph_runner.backend.errors import BackendUnavailableError
from cuda_graph_runner.backend.hookspecs import BackendSpec
from cuda_graph_runner.cli.command import main
from cuda_graph_runner.registry import BackendRegistry
from cuda_graph_runner.testing.fakes import RecordingBackend

LIMIT_S = 0.5
#: How long a "slow" probe blocks at most: far past the limit, yet bounded, so a registry
#: without a time limit makes the test fail instead of hanging it.
SLOW_S = 5.0


def _spec(name, probe, devices=("*",)):
    return BackendSpec(
        name=name, backend_class=RecordingBackend, phases=("decode",), devices=devices, probe=probe, api_version="1.1"
    )


@pytest.fixture()
def release():
    """An event slow probes wait on; set at teardown so their threads end."""
    event = threading.Event()
    yield event
    event.set()


def _slow(release):
    def slow_probe(device_type):
        release.wait(SLOW_S)
        return None

    return slow_probe


def test_a_slow_probe_is_listed_timed_out_and_the_others_still_listed(release):
    reg = BackendRegistry(autoload=False, probe_timeout_s=LIMIT_S)
    reg.register(_spec("slow", _slow(release)))
    reg.register(_spec("fast", lambda device_type: None))
    reg.register(_spec("missing_sdk", lambda device_type: "acme_sdk is not installed"))
    rows = {e.name: e for e in reg.entries("cpu")}
    assert rows["slow"].status == "unavailable"
    assert "timed out after 0.5 s" in rows["slow"].reason and "slow_probe('cpu')" in rows["slow"].reason
    assert "CUDA_GRAPH_RUNNER_PROBE_TIMEOUT_S" in rows["slow"].reason
    assert rows["fast"].status == "available" and rows["disabled"].status == "available"
    assert rows["missing_sdk"].reason == "acme_sdk is not installed"
    # The timed-out answer is kept: resolving does not wait again, and says why.
    with pytest.raises(BackendUnavailableError, match="timed out"):
        reg.resolve("decode", "slow", device="cpu")


def test_the_cli_lists_every_backend_when_one_probe_hangs(monkeypatch, release, capsys):
    monkeypatch.setenv(envs.PROBE_TIMEOUT_S, str(LIMIT_S))
    registry.reset_registry(keep_in_process=False)
    registry.register(_spec("slow", _slow(release)))
    registry.register(_spec("fast", lambda device_type: None))
    assert main(["backends", "--device", "cpu", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["slow"]["status"] == "unavailable" and "timed out" in rows["slow"]["reason"]
    assert rows["fast"]["status"] == "available"
    assert {"disabled", "full", "breakable"} <= set(rows)  # the installed plugins too


def test_probe_answers_are_kept_per_device_type():
    calls = []

    def counting_probe(device_type):
        calls.append(device_type)
        return None if device_type == "cpu" else f"not on {device_type}"

    reg = BackendRegistry(autoload=False, probe_timeout_s=LIMIT_S)
    reg.register(_spec("counted", counting_probe))
    for _ in range(5):  # five runners resolving the same backend
        reg.resolve("decode", "counted", device="cpu")
    reg.entries("cpu")
    assert calls == ["cpu"]
    assert {e.name: e for e in reg.entries("npu")}["counted"].reason == "not on npu"
    reg.entries("npu")
    assert calls == ["cpu", "npu"]


def test_a_probe_returning_true_is_available_and_false_unavailable():
    reg = BackendRegistry(autoload=False, probe_timeout_s=LIMIT_S)
    reg.register(_spec("yes", lambda device_type: True))
    reg.register(_spec("no", lambda device_type: False))
    rows = {e.name: e for e in reg.entries("cpu")}
    assert rows["yes"].status == "available" and rows["yes"].reason is None
    assert rows["no"].status == "unavailable" and "returned False" in rows["no"].reason


def test_a_raising_probe_is_failed_once_and_strict_mode_raises_each_time():
    calls = []

    def broken_probe(device_type):
        calls.append(device_type)
        raise OSError("driver exploded")

    reg = BackendRegistry(autoload=False, probe_timeout_s=LIMIT_S)
    reg.register(_spec("broken", broken_probe))
    row = {e.name: e for e in reg.entries("cpu")}["broken"]
    assert row.status == "failed" and "OSError: driver exploded" in row.reason
    reg.entries("cpu")
    assert calls == ["cpu"]
    strict = BackendRegistry(autoload=False, strict=True, probe_timeout_s=0)  # 0: no limit, this thread
    strict.register(_spec("broken", broken_probe))
    for _ in range(2):
        with pytest.raises(BackendUnavailableError, match="driver exploded"):
            strict.get("broken", device_type="cpu")
    assert calls == ["cpu", "cpu"]


@pytest.mark.parametrize("text", ["soon", "-1", "nan", "inf", "1e3", "1_0", "\u0668"])
def test_a_bad_time_limit_is_named_with_what_is_accepted(monkeypatch, text):
    monkeypatch.setenv(envs.PROBE_TIMEOUT_S, text)
    with pytest.raises(envs.EnvVarError, match=rf"CUDA_GRAPH_RUNNER_PROBE_TIMEOUT_S='{text}'.*a number >= 0"):
        BackendRegistry(autoload=False)
    with pytest.raises(ValueError, match="probe_timeout_s=-2.*a number >= 0"):
        BackendRegistry(autoload=False, probe_timeout_s=-2)


def test_the_time_limit_comes_from_the_environment_or_the_argument(monkeypatch):
    assert BackendRegistry(autoload=False).probes.timeout_s == 60.0
    monkeypatch.setenv(envs.PROBE_TIMEOUT_S, " 0.25 ")
    assert BackendRegistry(autoload=False).probes.timeout_s == 0.25
    assert BackendRegistry(autoload=False, probe_timeout_s=3).probes.timeout_s == 3.0
