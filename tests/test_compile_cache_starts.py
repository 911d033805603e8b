"""CPU tests of ``benchmarks/compile_cache_starts.py``'s parent process: a user's wrong
backend or dtype ends in a message and exit 2, not a traceback (the child starts are
faked: nothing compiles here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import compile_cache_starts  # noqa: E402


def _fake_start(compile_s):
    result = {"backend": "full", "compile_s": compile_s, "capture_s": 0.1, "compile_times": ""}

    def run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 0, stdout="RESULT " + json.dumps(result) + "\n", stderr="")

    return run


@pytest.mark.parametrize("compile_s", [None, 0.0])
def test_a_backend_that_compiles_nothing_gets_a_message_and_exit_2(monkeypatch, capsys, compile_s):
    monkeypatch.setattr(compile_cache_starts.subprocess, "run", _fake_start(compile_s))
    rc = compile_cache_starts.main(["--backend", "breakable", "--sizes", "1", "--pairs", "1", "--no-prime"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "'breakable' compiled nothing" in err and "full+torch_compile" in err


def test_compile_seconds_give_the_ratio(monkeypatch, capsys):
    monkeypatch.setattr(compile_cache_starts.subprocess, "run", _fake_start(2.0))
    assert compile_cache_starts.main(["--sizes", "1", "--pairs", "1", "--no-prime"]) == 0
    assert "= 100%" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--dtype", "foo"], "invalid choice: 'foo'"),
        (["--model", "nope"], "invalid choice: 'nope'"),
        (["--backend", "bogus"], "--backend 'bogus': unknown backend; installed:"),
        (["--sizes", "0"], "'0' is not an integer >= 1"),
        (["--pairs", "0"], "'0' is not an integer >= 1"),
        (["--replays", "x"], "'x' is not an integer >= 0"),
        (["--backend", "disabled"], "--backend 'disabled' compiles nothing"),
        (["--backend", "full:bogus"], "--backend 'full:bogus': unknown compiler 'bogus'; accepted: eager, inductor"),
        (["--backend", "compiled:inductor"], "backend 'compiled' takes no tc_compiler; accepted: 'compiled' alone"),
        (
            ["--backend", "full"],
            "--backend 'full' compiles nothing; accepted: a compiling backend (compiled, full+torch_compile, "
            "tc_piecewise:inductor)",
        ),
        (["--backend", "tc_piecewise:eager"], "--backend 'tc_piecewise:eager' compiles nothing"),
        (["--backend", "breakable+torch_compile"], "backend 'breakable' takes no torch_compile"),
        (["--device", "foo"], "--device 'foo': not a torch device"),
        (["--device", "meta"], "--device 'meta': a meta tensor has no data"),
        (["--device", "cuda:99"], "--device 'cuda:99': "),  # no CUDA here, or no device 99 on a GPU machine
    ],
)
def test_a_bad_argument_is_a_usage_error_before_any_start(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(compile_cache_starts.subprocess, "run", pytest.fail)  # no start may run
    with pytest.raises(SystemExit) as info:
        compile_cache_starts.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_start_that_names_a_user_s_mistake_is_one_line_and_exit_2(monkeypatch, capsys):
    def run(cmd, **kwargs):
        stderr = "compile_cache_starts: backend 'breakable' runs on cuda, not on cpu\n"
        return subprocess.CompletedProcess(cmd, 2, stdout="", stderr=stderr)

    monkeypatch.setattr(compile_cache_starts.subprocess, "run", run)
    assert compile_cache_starts.main(["--backend", "breakable", "--pairs", "1", "--no-prime"]) == 2
    assert capsys.readouterr().err.strip() == "compile_cache_starts: backend 'breakable' runs on cuda, not on cpu"


def test_the_child_turns_an_unusable_backend_into_one_line_and_exit_2(capsys):
    # a real child start: npu cannot run on the CPU device (nothing compiles)
    rc = compile_cache_starts.main(["--child", "--backend", "npu", "--sizes", "1"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("compile_cache_starts: ") and "Traceback" not in err
