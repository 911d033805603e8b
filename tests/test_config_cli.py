"""The ``config`` subcommand (cli_config): exit status, JSON output, sources, errors."""

from __future__ import annotations

import argparse
import json
import sys
import types
import warnings

import pytest

from cuda_graph_runner.cli.config_command import add_config_subcommand, run_config
from cuda_graph_runner.config import flags as flags_module

INSTALLED = {
    "disabled": frozenset({"decode", "prefill"}),
    "full": frozenset({"decode"}),
    "breakable": frozenset({"decode", "prefill"}),
}


@pytest.fixture
def fake_registry(monkeypatch):
    """A registry module reporting INSTALLED, in place of whatever is installed here."""
    module = types.ModuleType("cuda_graph_runner.registry")
    module.backend_phases = lambda: dict(INSTALLED)
    monkeypatch.setitem(sys.modules, "cuda_graph_runner.registry", module)


@pytest.fixture
def no_registry(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda_graph_runner.registry", None)  # makes the import fail


def run(argv, capsys):
    parser = argparse.ArgumentParser(prog="cuda-graph-runner")
    add_config_subcommand(parser.add_subparsers(dest="command"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # legacy flags; their warnings are tested elsewhere
        args = parser.parse_args(["config", *argv])
    assert args.func is run_config
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_valid_config_prints_values_and_sources(fake_registry, capsys):
    code, out, err = run(
        [
            "--disable-cuda-graph",
            "--cuda-graph-backend-decode",
            "full",
            "--cuda-graph-bs-decode",
            "4,1",
            "--cuda-graph-config",
            '{"decode": {"max_bs": 8}}',
        ],
        capsys,
    )
    assert code == 0, err
    report = json.loads(out)
    checks = {
        "compile_sizes": None,
        "torch_compile": False,
        "torch_compile_max_bs": None,
        "owned_outputs": False,
        "host_value_guard": True,
        "verify": False,
        "verify_first_n": 3,
        "verify_every": 0,
        "warmup": "auto",
        "variants": None,
        "padded_eager": False,
        "eager_through": False,
        "full_prefill_max_req": None,
        "check_weights_every": 0,
        "forward_asleep": "eager",
        "capture": "blocking",
        "mixed_tokens": None,
        "mixed_requests": None,
    }
    assert report["config"] == {
        "decode": {"backend": "full", "max_bs": 8, "bs": [1, 4], "tc_compiler": "eager", **checks},
        "prefill": {"backend": "disabled", "max_bs": None, "bs": None, "tc_compiler": "eager", **checks},
    }
    default_sources = {key: "default" for key in checks}
    assert report["sources"] == {
        "decode": {
            "backend": "flag:--cuda-graph-backend-decode",
            "max_bs": "json:--cuda-graph-config",
            "bs": "flag:--cuda-graph-bs-decode",
            "tc_compiler": "default",
            **default_sources,
        },
        "prefill": {
            "backend": "legacy:--disable-cuda-graph",
            "max_bs": "default",
            "bs": "default",
            "tc_compiler": "default",
            **default_sources,
        },
    }
    assert report["backends_checked"] is True


def test_defaults_print_auto(fake_registry, capsys):
    code, out, _ = run([], capsys)
    assert code == 0
    report = json.loads(out)
    assert report["config"]["decode"]["backend"] is None
    assert set(report["sources"]["prefill"].values()) == {"default"}


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (
            ["--cuda-graph-backend-prefill", "tc_piecewise"],
            ["prefill.backend='tc_piecewise'", "pip install cuda-graph-runner-tc-piecewise", "installed: breakable"],
        ),
        (["--cuda-graph-backend-prefill", "full"], ["does not support phase 'prefill'", "supports: decode"]),
        (
            ["--cuda-graph-backend-decode", "tc_piecewise", "--cuda-graph-backend-decode", "full"],
            ["decode.backend='tc_piecewise'", "a later flag replaced it", "pip install cuda-graph-runner-tc-piecewise"],
        ),
    ],
)
def test_invalid_config_exits_2_with_message_on_stderr(fake_registry, capsys, argv, fragments):
    code, out, err = run(argv, capsys)
    assert code == 2
    assert out == ""
    assert err.startswith("error: invalid cuda-graph config")
    for fragment in fragments:
        assert fragment in err


def test_without_registry_names_are_not_checked(no_registry, capsys):
    code, out, err = run(["--cuda-graph-backend-decode", "acme"], capsys)
    assert code == 0
    report = json.loads(out)
    assert report["config"]["decode"]["backend"] == "acme"
    assert report["backends_checked"] is False
    assert "backend names not checked" in err


def test_bad_flag_value_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as info:
        run(["--cuda-graph-max-bs-decode", "-1"], capsys)
    assert info.value.code == 2
    assert "--cuda-graph-max-bs-decode" in capsys.readouterr().err


def test_with_the_real_registry_defaults_are_valid(capsys):
    # auto backends are never checked by name, so this passes whatever is installed
    code, out, err = run([], capsys)
    assert code == 0, err
    assert json.loads(out)["config"]["prefill"]["tc_compiler"] == "eager"


def test_legacy_flag_warning_reaches_the_user(fake_registry, capsys):
    flags_module._WARNED_FLAGS.discard("--cuda-graph-max-bs")
    parser = argparse.ArgumentParser(prog="cuda-graph-runner")
    add_config_subcommand(parser.add_subparsers(dest="command"))
    with pytest.warns(FutureWarning, match="--cuda-graph-max-bs is deprecated"):
        args = parser.parse_args(["config", "--cuda-graph-max-bs", "16"])
    assert run_config(args) == 0
    assert json.loads(capsys.readouterr().out)["config"]["decode"]["max_bs"] == 16


def test_compile_sizes_without_a_compiler_exit_2_with_the_real_registry(capsys):
    """``full`` reads torch_compile and compile_sizes: sizes with torch_compile off would
    compile nothing, so ``config`` refuses them (before, only building the backend did)."""
    pytest.importorskip("cuda_graph_runner_full", reason="the full plugin is not installed")
    code, out, err = run(["--cuda-graph-backend-decode", "full", "--cuda-graph-compile-sizes-decode", "1,2"], capsys)
    assert code == 2 and out == ""
    assert "decode.compile_sizes=[1, 2] (from flag:--cuda-graph-compile-sizes-decode)" in err
    assert "compiles nothing with torch_compile off" in err
    code, out, err = run(
        [
            "--cuda-graph-backend-decode",
            "full",
            "--cuda-graph-compile-sizes-decode",
            "1,2",
            "--enable-torch-compile",
        ],
        capsys,
    )
    assert code == 0, err
    assert json.loads(out)["config"]["decode"]["compile_sizes"] == [1, 2]


def test_compile_size_above_the_runners_default_max_is_refused_by_config(fake_registry, capsys):
    """With neither bs nor max_bs the runner captures up to 256 (decode): ``config`` once
    printed compile size 512 as valid though it would never be captured."""
    code, out, err = run(["--cuda-graph-compile-sizes-decode", "512"], capsys)
    assert code == 2 and out == ""
    assert "decode.compile_sizes=[512]" in err and "the runner's default 256" in err
    assert "accepted: sizes <= 256, or set max_bs (or bs)" in err
    code, out, err = run(["--cuda-graph-compile-sizes-decode", "512", "--cuda-graph-max-bs-decode", "512"], capsys)
    assert code == 0, err


def test_parsing_alone_keeps_a_compile_size_above_the_default_max():
    """The bench sets max_bs to its largest size after parsing, so only validate() refuses it."""
    from cuda_graph_runner.config import CudaGraphConfig, CudaGraphConfigError

    config = CudaGraphConfig.from_dict({"decode": {"compile_sizes": [512]}})
    assert config.decode.compile_sizes == [512]
    with pytest.raises(CudaGraphConfigError, match="not captured"):
        config.validate()
    config.with_phase("decode", max_bs=512).validate()
