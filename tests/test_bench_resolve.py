"""The bench resolves each backend once and hands the instance to the runner."""

from __future__ import annotations

import json

import pytest

from cuda_graph_runner.cli.bench import command as bench
from cuda_graph_runner.cli.command import main
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


def _entry(name, ok, reason=""):
    from types import SimpleNamespace

    return SimpleNamespace(name=name, phases=("decode",), ok=ok, reason=reason)


def test_eager_note_names_why_each_backend_cannot_run_or_which_one_was_turned_off(monkeypatch):
    """The bench's note when it runs eager only on the CPU: the reasons of the backends that
    cannot run there, or, where one it would pick is usable but the environment turned it
    off, that one (not "no backend is usable")."""
    import torch

    from cuda_graph_runner import registry
    from cuda_graph_runner.cli.bench import backends as bench_backends

    seen = []

    def fake_list(device_type=None):
        seen.append(device_type)
        return [
            _entry("full", False, "needs cuda"),
            _entry("compiled", compiled_ok, "" if compiled_ok else "not built"),
        ]

    monkeypatch.setattr(registry, "list_backends", fake_list)
    cpu = torch.device("cpu")
    compiled_ok = False
    note = bench_backends._no_backend_note("decode", None, cpu)
    assert (
        note == "no decode graph backend is usable on cpu (full: needs cuda; compiled: not built); running eager only"
    )
    compiled_ok = True
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_BENCH_CPU_COMPILED", "0")
    note = bench_backends._no_backend_note("decode", None, cpu)
    assert note == (
        "decode backend compiled not picked (CUDA_GRAPH_RUNNER_BENCH_CPU_COMPILED=0) and no other decode graph "
        "backend is usable on cpu (full: needs cuda); running eager only"
    )
    assert seen == ["cpu", "cpu"]  # probed for the bench's device, not each backend's first one


def test_a_real_model_on_the_cpu_runs_compiled_only_when_asked(monkeypatch, capsys):
    """``--model smollm2-135m``: the bench does not pick the CPU ``compiled`` backend itself
    (its compile takes minutes for about eager's speed there) and says so; named in
    ``--decode-backends`` it runs."""
    import pytest
    import torch

    from cuda_graph_runner.cli.bench.backends import BenchRequestError, plan_phase
    from cuda_graph_runner.config import CudaGraphConfig
    from cuda_graph_runner.reference import real_model
    from cuda_graph_runner.registry import list_backends

    reason = real_model.REAL_MODELS["smollm2-135m"].cpu_compiled_opt_in
    assert reason, "smollm2-135m runs compiled by default"
    asked = []

    def spy(phase, selection, config, device, default_max, not_picked=None):
        asked.append((phase, selection, not_picked))
        raise BenchRequestError("stop here", 2)

    monkeypatch.setattr(real_model, "check_available", lambda name: real_model.REAL_MODELS[name])
    monkeypatch.setattr(bench, "plan_phase", spy)
    assert main(["bench", "--device", "cpu", "--model", "smollm2-135m", "--no-prefill"]) == 2
    assert main(["bench", "--device", "cpu", "--model", "tiny", "--no-prefill"]) == 2
    capsys.readouterr()
    [(phase, selection, not_picked), (_, _, on_tiny)] = asked
    assert (phase, selection, on_tiny) == ("decode", None, None)
    assert not_picked == f"not picked for --model smollm2-135m: it {reason} (--decode-backends compiled runs it)"

    if not any(e.name == "compiled" and e.ok for e in list_backends("cpu")):
        pytest.skip("backend compiled cannot run here: its picking is what the rest checks")
    cpu = torch.device("cpu")
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_BENCH_CPU_COMPILED", "1")  # the bench's default (the suite's is 0)
    [choice] = plan_phase("decode", None, CudaGraphConfig(), cpu, 4, not_picked)
    assert choice.label == "disabled" and choice.backend is None
    assert choice.note == f"decode backend compiled {not_picked}; running eager only"
    [choice] = plan_phase("decode", "compiled", CudaGraphConfig(), cpu, 4, not_picked)
    assert choice.label == "compiled" and choice.backend is not None and choice.explicit
    [choice] = plan_phase("decode", None, CudaGraphConfig(), cpu, 4)
    assert choice.label == "compiled"


def test_the_bench_picks_compiled_on_the_cpu_while_its_toolchain_works(monkeypatch):
    import torch

    from cuda_graph_runner.cli.bench.backends import plan_phase
    from cuda_graph_runner.config import CudaGraphConfig
    from cuda_graph_runner.registry import reset_registry

    toolchain = pytest.importorskip(
        "cuda_graph_runner_compiled.toolchain", reason="uses the compiled backend (cuda-graph-runner-compiled)"
    )

    def choose():
        (choice,) = plan_phase("decode", None, CudaGraphConfig(), torch.device("cpu"), default_max=4)
        return choice

    monkeypatch.setenv("CUDA_GRAPH_RUNNER_BENCH_CPU_COMPILED", "1")  # the suite turns it off (conftest.py)
    reset_registry(keep_in_process=False)
    try:
        monkeypatch.setattr(toolchain, "toolchain_problem", lambda: None)
        choice = choose()
        assert choice.label == "compiled" and choice.backend is not None and choice.note == ""
        reset_registry(keep_in_process=False)
        monkeypatch.setattr(toolchain, "toolchain_problem", lambda: "no C++ compiler here")
        choice = choose()
        assert choice.backend is None and "compiled: no C++ compiler here" in choice.note
        reset_registry(keep_in_process=False)
        monkeypatch.setattr(toolchain, "toolchain_problem", lambda: None)
        monkeypatch.setenv("CUDA_GRAPH_RUNNER_BENCH_CPU_COMPILED", "0")
        assert choose().backend is None
    finally:
        reset_registry(keep_in_process=False)
