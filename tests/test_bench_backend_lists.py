"""``bench --decode-backends ''`` once ran the default bench silently; an empty list is an error."""

from __future__ import annotations

import argparse

import pytest

from cuda_graph_runner.bench_args import add_bench_arguments


@pytest.mark.parametrize("flag", ["--decode-backends", "--prefill-backends"])
@pytest.mark.parametrize("value", ["", " , "])
def test_an_empty_backend_list_is_refused_with_what_is_accepted(flag, value, capsys):
    parser = argparse.ArgumentParser(prog="cuda-graph-runner bench")
    add_bench_arguments(parser)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args([flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected at least one backend name" in err and repr(value) in err


def test_a_list_with_names_passes_unchanged():
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    assert parser.parse_args(["--decode-backends", "full,breakable"]).decode_backends == "full,breakable"


def test_an_unknown_name_is_reported_before_a_known_name_that_cannot_run():
    """``full,nope`` on the CPU once reported only that full needs CUDA (exit 1); the typo
    further down the list is the user's first mistake (exit 2)."""
    import torch

    from cuda_graph_runner.bench_backends import BenchRequestError, plan_phase
    from cuda_graph_runner.config import CudaGraphConfig

    with pytest.raises(BenchRequestError) as exc:
        plan_phase("decode", "full,nope", CudaGraphConfig(), torch.device("cpu"), 4)
    assert exc.value.exit_code == 2
    assert "'nope'" in str(exc.value) and "installed:" in str(exc.value)


def test_compile_sizes_go_to_the_compiled_label_only():
    from cuda_graph_runner.bench_backends import label_fields
    from cuda_graph_runner.config import CudaGraphConfig

    config = CudaGraphConfig.from_dict({"decode": {"compile_sizes": [1, 32]}}).decode
    # full,full:inductor: the eager label drops them, the compiled one keeps the config's.
    assert label_fields(config, "full", None, 64, True) == {"backend": "full", "max_bs": 64, "compile_sizes": None}
    assert label_fields(config, "full", "inductor", 64, True) == {
        "backend": "full",
        "max_bs": 64,
        "tc_compiler": "inductor",
    }
    # A lone eager label keeps them, so its backend names the mistake.
    assert "compile_sizes" not in label_fields(config, "full", None, 64, False)
