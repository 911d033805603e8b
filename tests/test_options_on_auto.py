"""A backend option (``compile_sizes``, ``tc_compiler``) set with the backend on auto is
checked against the backend auto picks, as if it were named: ``config`` (the device's
default) and ``bench`` (what it runs, its own pick on the CPU included) refuse one that
nothing there reads, exit 2, before any work; only a *named* ``disabled`` is exempt."""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner import registry
from cuda_graph_runner.cli.bench import command as bench
from cuda_graph_runner.cli.bench.backends import BenchRequestError, plan_phase
from cuda_graph_runner.cli.command import main
from cuda_graph_runner.config import CudaGraphConfig

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's defaults; this machine has CUDA")
needs_compiled = pytest.mark.skipif(
    "compiled" not in registry.backend_phases(),
    reason="needs the bench's CPU pick 'compiled' (cuda-graph-runner-compiled)",
)
SIZES = ["--cuda-graph-compile-sizes-decode", "1"]
TINY = ["--batch-sizes", "1", "--iters", "1", "--warmup", "0", "--steps", "1", "--prompt-len", "2", "--no-prefill"]


@pytest.fixture()
def no_work(monkeypatch):
    def load_model(*args, **kwargs):
        raise AssertionError("the bench loaded a model before refusing the option")

    monkeypatch.setattr(bench, "load_model", load_model)


@cpu_only
def test_config_refuses_compile_sizes_that_the_auto_backend_does_not_read(capsys):
    assert main(["config", *SIZES]) == 2
    err = capsys.readouterr().err
    assert "backend auto (here 'disabled', the default on cpu) does not read option 'compile_sizes'" in err
    assert "backends that read it: full" in err


def test_config_named_like_auto_gives_the_same_answer(capsys):
    """Naming the backend auto picks here gives the same exit status as auto (disabled
    excepted, which is exempt only when named)."""
    default = registry.get_registry().default_backend("decode", registry.default_device_type())
    if default == "disabled":
        pytest.skip("the default here is disabled, exempt only when named (the test above)")
    assert main(["config", *SIZES]) == main(["config", "--cuda-graph-backend-decode", default, *SIZES]) == 2


def test_a_named_disabled_keeps_the_command_line_valid(capsys):
    assert main(["config", "--disable-cuda-graph-decode", *SIZES]) == 0


@cpu_only
@needs_compiled
def test_bench_refuses_compile_sizes_its_own_pick_does_not_read(capsys, no_work, monkeypatch):
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_BENCH_CPU_COMPILED", "1")
    assert main(["bench", *SIZES, *TINY]) == 2
    err = capsys.readouterr().err
    assert "backend auto (here 'compiled', picked by the bench on cpu) does not read option 'compile_sizes'" in err


@cpu_only
def test_bench_refuses_compile_sizes_when_it_runs_eager_only(capsys, no_work, monkeypatch):
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_BENCH_CPU_COMPILED", "0")
    assert main(["bench", *SIZES, *TINY]) == 2
    assert "backend auto (here 'disabled'" in capsys.readouterr().err


@cpu_only
@needs_compiled
def test_plan_of_an_auto_phase_refuses_the_option_instead_of_running_eager(monkeypatch):
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_BENCH_CPU_COMPILED", "1")
    config = CudaGraphConfig.from_dict({"decode": {"compile_sizes": [1]}})
    with pytest.raises(BenchRequestError) as info:
        plan_phase("decode", None, config, torch.device("cpu"), 4)
    assert info.value.exit_code == 2 and "the bench picked 'compiled' on cpu" in str(info.value)
