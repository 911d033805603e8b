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
    rc = compile_cache_starts.main(["--backend", "full", "--sizes", "1", "--pairs", "1", "--no-prime"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "'full' compiled nothing" in err and "full:inductor" in err


def test_compile_seconds_give_the_ratio(monkeypatch, capsys):
    monkeypatch.setattr(compile_cache_starts.subprocess, "run", _fake_start(2.0))
    assert compile_cache_starts.main(["--sizes", "1", "--pairs", "1", "--no-prime"]) == 0
    assert "= 100%" in capsys.readouterr().out


def test_an_unknown_dtype_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        compile_cache_starts.main(["--dtype", "foo"])
    assert info.value.code == 2
    assert "invalid choice: 'foo'" in capsys.readouterr().err
