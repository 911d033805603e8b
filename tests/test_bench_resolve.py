"""The bench resolves each backend once and hands the instance to the runner (issue 18)."""

from __future__ import annotations

import json

from cuda_graph_runner import bench
from cuda_graph_runner.cli import main
from cuda_graph_runner.registry import get_registry
from cuda_graph_runner.testing.fakes import RecordingBackend


def test_each_backend_is_resolved_once_and_the_runner_gets_that_instance(monkeypatch, tmp_path, capsys):
    resolved = []

    def resolve(phase, config=None, *, device=None, **kwargs):
        backend = RecordingBackend(str(device), phase=phase)
        resolved.append((phase, config[phase].backend, backend))
        return backend

    monkeypatch.setattr(get_registry(), "resolve", resolve)
    runners = []
    real = bench._make_runner

    def make_runner(*args):
        runners.append(real(*args))
        return runners[-1]

    monkeypatch.setattr(bench, "_make_runner", make_runner)
    path = tmp_path / "b.json"
    argv = ["bench", "--device", "cpu", "--decode-backends", "recording", "--batch-sizes", "1", "2", "--no-prefill"]
    argv += ["--iters", "1", "--warmup", "0", "--steps", "1", "--prompt-len", "2", "--json", str(path)]
    assert main(argv) == 0, capsys.readouterr().err
    # One resolve for the one backend: the runner did not resolve the name again.
    [(phase, name, backend)] = resolved
    assert (phase, name) == ("decode", "recording")
    [runner] = runners
    assert runner.backend is backend and any(e[0] == "replay" for e in backend.events)
    doc = json.load(open(path))
    assert {t["method"] for t in doc["timings"]} == {"recording"}
