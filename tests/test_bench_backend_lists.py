"""``bench --decode-backends ''`` once ran the default bench silently; an empty list is an error."""

from __future__ import annotations

import argparse

import pytest

from cuda_graph_runner.cli.bench.args import add_bench_arguments


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

    from cuda_graph_runner.cli.bench.backends import BenchRequestError, plan_phase
    from cuda_graph_runner.config import CudaGraphConfig

    with pytest.raises(BenchRequestError) as exc:
        plan_phase("decode", "full,nope", CudaGraphConfig(), torch.device("cpu"), 4)
    assert exc.value.exit_code == 2
    assert "'nope'" in str(exc.value) and "installed:" in str(exc.value)


READERS = {"tc_compiler": ["tc_piecewise"], "compile_sizes": ["full"], "torch_compile": ["full"]}


@pytest.mark.parametrize(
    "backend, compiler, takes",
    [
        ("full", "torch_compile", True),
        ("full", "inductor", False),
        ("full", None, False),
        ("tc_piecewise", "inductor", False),
        ("tc_piecewise", "torch_compile", False),
    ],
)
def test_only_a_compiling_label_of_a_reading_backend_takes_compile_sizes(backend, compiler, takes):
    from cuda_graph_runner.cli.bench.backends import takes_compile_sizes

    assert takes_compile_sizes(backend, compiler, READERS) is takes


def _flag_config():
    from cuda_graph_runner.config import CudaGraphConfig, add_cuda_graph_args

    parser = argparse.ArgumentParser()
    add_cuda_graph_args(parser)
    return CudaGraphConfig.from_args(parser.parse_args(["--cuda-graph-compile-sizes-decode", "1,32"]))


@pytest.mark.parametrize(
    "backend, compiler", [("full", None), ("full", "eager"), ("breakable", None), ("tc_piecewise", "inductor")]
)
def test_compile_sizes_are_dropped_for_the_other_labels_as_if_never_set(backend, compiler):
    """``full,full+torch_compile`` or ``breakable,full+torch_compile`` with compile sizes: the label
    that does not use them runs without them, value and source (the backend options check
    would otherwise name a value the user never gave that label)."""
    from cuda_graph_runner.backend.options import _set_options
    from cuda_graph_runner.cli.bench.backends import label_config

    out = label_config(_flag_config(), "decode", backend, compiler, 64, READERS, True)
    assert out.decode.compile_sizes is None and ("decode", "compile_sizes") not in out.sources
    assert "compile_sizes" not in [key for key, _, _ in _set_options(out, "decode")]


def test_the_compiling_label_keeps_them_and_a_lone_eager_label_keeps_them_to_be_refused():
    from cuda_graph_runner.cli.bench.backends import label_config

    config = _flag_config()
    kept = label_config(config, "decode", "full", "torch_compile", 64, READERS, True)
    assert kept.decode.compile_sizes == [1, 32] and kept.decode.torch_compile == "inductor"
    assert kept.decode.torch_compile_max_bs == 64  # every size the bench measures is compiled
    assert kept.sources[("decode", "compile_sizes")] == "flag:--cuda-graph-compile-sizes-decode"
    lone = label_config(config, "decode", "full", None, 64, READERS, False)
    assert lone.decode.compile_sizes == [1, 32]
