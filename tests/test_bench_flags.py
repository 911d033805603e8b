"""Every bench flag is checked before any work: a bad count, an output path that cannot be
written, or an integer spelled with other than ASCII digits is one ``error:`` line naming
the value and what is accepted, exit 2, before a model is loaded."""

from __future__ import annotations

import argparse
import os

import pytest

from cuda_graph_runner.backend import envs
from cuda_graph_runner.cli.bench import command as bench
from cuda_graph_runner.cli.command import main
from cuda_graph_runner.config.integers import count_arg, parse_digits

TINY = ["--batch-sizes", "1", "--iters", "1", "--warmup", "0", "--steps", "1", "--prompt-len", "2", "--no-prefill"]


@pytest.fixture()
def no_work(monkeypatch):
    """Fails the test if the bench gets as far as loading a model."""

    def load_model(*args, **kwargs):
        raise AssertionError("the bench loaded a model before refusing its flags")

    monkeypatch.setattr(bench, "load_model", load_model)


def _usage_error(argv, capsys):
    """The exit status (argparse's SystemExit or main's return) and stderr of ``main(argv)``."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


@pytest.mark.parametrize(
    "flag, value, accepted",
    [
        ("--iters", "-1", "an integer >= 1"),
        ("--iters", "0", "an integer >= 1"),
        ("--prompt-len", "0", "an integer >= 1"),
        ("--steps", "0", "an integer >= 1"),
        ("--warmup", "-1", "an integer >= 0"),
        ("--tp", "0", "an integer >= 1"),
        ("--iters", "\u0668", "an integer >= 1"),  # ARABIC-INDIC DIGIT EIGHT: int() reads 8
        ("--warmup", "1_0", "an integer >= 0"),  # int() reads 10
        ("--batch-sizes", "\u0668", "integers >= 1"),
        ("--prefill-tokens", "1_6", "integers >= 1"),
        ("--cuda-graph-max-bs-decode", "\uff18", "an integer >= 1"),  # FULLWIDTH DIGIT EIGHT
        ("--cuda-graph-bs-decode", "1_0", "integers >= 1"),
    ],
)
def test_bad_count_is_one_line_naming_value_and_accepted(flag, value, accepted, capsys, no_work):
    code, err = _usage_error(["bench", flag, value], capsys)
    assert code == 2
    [line] = [line for line in err.splitlines() if "error:" in line]
    assert f"argument {flag}:" in line and repr(value) in line and f"accepted: {accepted}" in line


def test_json_into_a_directory_is_refused_before_the_run(tmp_path, capsys, no_work):
    code, err = _usage_error(["bench", "--json", str(tmp_path), *TINY], capsys)
    assert code == 2 and "is a directory" in err and str(tmp_path) in err


def test_json_onto_an_unwritable_file_is_refused(tmp_path, capsys, no_work):
    target = tmp_path / "ro.json"
    target.write_text("{}")
    target.chmod(0o444)
    try:
        if os.access(target, os.W_OK):
            pytest.skip("running as a user who may write read-only files (root)")
        code, err = _usage_error(["bench", "--json", str(target), *TINY], capsys)
        assert code == 2 and "not writable" in err
    finally:
        target.chmod(0o644)


def test_json_where_access_says_yes_but_open_fails_is_refused_before_the_run(tmp_path, capsys, no_work, monkeypatch):
    # Root passes os.access everywhere (/proc, /sys), and the open then fails after the run.
    import builtins

    real_open = builtins.open
    target = str(tmp_path / "out.json")

    def refusing(path, *args, **kwargs):
        if str(path) == target:
            raise PermissionError(13, "Permission denied", target)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refusing)
    code, err = _usage_error(["bench", "--json", target, *TINY], capsys)
    assert code == 2 and "cannot be written (Permission denied)" in err and not os.path.exists(target)


def test_json_probe_leaves_no_file_behind(tmp_path):
    from cuda_graph_runner.cli.bench.args import output_file

    target = tmp_path / "new.json"
    assert output_file(str(target)) == str(target) and not target.exists()


def test_plot_in_a_format_matplotlib_cannot_write_is_refused(tmp_path, capsys, no_work):
    pytest.importorskip("matplotlib", reason="the plot format is checked with matplotlib (cuda-graph-runner[plot])")
    code, err = _usage_error(["bench", "--plot", str(tmp_path / "plot.txt"), *TINY], capsys)
    assert code == 2 and "cannot write .txt" in err and ".png" in err


def test_json_and_plot_onto_one_file_is_refused(tmp_path, capsys, no_work):
    same = str(tmp_path / "out.png")
    code, err = _usage_error(["bench", "--json", same, "--plot", same, *TINY], capsys)
    assert code == 2 and "same file" in err


def test_prefill_requests_above_every_token_count_are_refused(capsys, no_work):
    argv = ["bench", "--batch-sizes", "1", "--prefill-tokens", "4", "--prefill-requests", "2", "8"]
    code, err = _usage_error(argv, capsys)
    assert code == 2 and "--prefill-requests 8: more requests than the largest --prefill-tokens (4)" in err


def test_output_paths_are_checked_for_a_namespace_built_in_code(tmp_path, capsys, no_work):
    from cuda_graph_runner.cli.command import build_parser

    args = build_parser().parse_args(["bench", *TINY])
    args.json_path = str(tmp_path)  # past argparse's type check
    assert bench.run_bench(args) == 2
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["\u0668", "1_0", "+1", "-1", " 1", "1 ", "", "0x10", "1.0", "\uff11", "9" * 5000])
def test_parse_digits_accepts_ascii_digits_only(text):
    assert parse_digits(text) is None


def test_parse_digits_reads_ascii_digits():
    assert [parse_digits(t) for t in ("0", "7", "0012", "65536")] == [0, 7, 12, 65536]


def test_count_arg_bounds():
    assert count_arg(0)("0") == 0 and count_arg(1, 4)("4") == 4
    for bad in ("0", "5", "\u0664"):
        with pytest.raises(argparse.ArgumentTypeError, match="accepted: an integer >= 1 and <= 4"):
            count_arg(1, 4)(bad)


@pytest.mark.parametrize("text", ["\u0668", "1_0", "-1", "\uff13"])
def test_count_environment_variable_takes_ascii_digits_only(text):
    with pytest.raises(envs.EnvVarError, match="CUDA_GRAPH_RUNNER_VERIFY_EVERY=.*digits 0-9"):
        envs.get(envs.VERIFY_EVERY, {envs.VERIFY_EVERY: text})
    assert envs.get(envs.VERIFY_EVERY, {envs.VERIFY_EVERY: " 12 "}) == 12
