"""``benchmarks/eager_first.py``: tokens served by a time, the targets' ratios from three
starts' timelines (first steps as medians over repeats), the seeded traffic, the timeline
plot (with matplotlib), one start's heap settled before t = 0 and its first step's phases
(in process, CPU, fake graphs), fresh compile caches per start, the run's time limit and
its option checks."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import eager_first  # noqa: E402


def _start(mode, capture_ms, rows, full_speed_ms=None, first_replay_ms=None):
    timeline = [
        {"step": i, "bs": bs, "end_ms": end, "step_ms": ms, "capture_ms": cap, "ready": ready}
        for i, (bs, end, ms, cap, ready) in enumerate(rows)
    ]
    return {
        "mode": mode,
        "capture_call_ms": capture_ms,
        "first_step_ms": timeline[0]["end_ms"],
        "first_replay_ms": first_replay_ms,
        "full_speed_ms": full_speed_ms if full_speed_ms is not None else capture_ms,
        "pool_mib": None,
        "timeline": timeline,
    }


def test_summary_ratios_from_three_timelines():
    starts = {
        # blocking: 1000 ms of capture, then its first token at 1001 ms
        "blocking": _start("blocking", 1000.0, [(4, 1001.0, 1.0, 0.0, 3), (4, 1002.0, 1.0, 0.0, 3)]),
        # eager_first: tokens at 10, 40, 900 ms and 1200 ms; every size replaying at 1300 ms
        "eager_first": _start(
            "eager_first",
            0.1,
            [(2, 10.0, 10.0, 20.0, 1), (3, 40.0, 10.0, 20.0, 2), (5, 900.0, 2.0, 20.0, 2), (8, 1200.0, 2.0, 20.0, 3)],
            full_speed_ms=1300.0,
            first_replay_ms=40.0,
        ),
        "eager": _start("eager", 0.05, [(2, 9.0, 9.0, 0.0, 0), (3, 19.0, 10.0, 0.0, 0), (5, 30.0, 11.0, 0.0, 0)]),
    }
    result = eager_first.summary(starts)
    assert result["first_step_ratio"] == pytest.approx(10.0 / 9.0)
    assert result["full_speed_ratio"] == pytest.approx(1.3)
    assert result["tokens_by_blocking_first"] == {"eager_first": 10, "eager": 10}
    assert result["tokens_ratio"] == pytest.approx(1.0)
    assert eager_first.tokens_by(starts["eager_first"]["timeline"], 40.0) == 5
    line = eager_first.targets_line(result)
    assert "first_step_ratio 1.11 (<= 1.1, missed)" in line and "full_speed_ratio 1.30 (<= 1.5, met)" in line
    assert "tokens_ratio 1.00 (>= 0.5, met)" in line


def test_traffic_is_seeded_and_draws_small_sizes_more_often():
    sizes = eager_first.traffic([1, 8, 64], 3000, seed=3)
    assert sizes == eager_first.traffic([64, 8, 1], 3000, seed=3)
    assert sizes.count(1) > sizes.count(8) > sizes.count(64) > 0


def test_plot_draws_the_timeline(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (extra [plot])")
    rows = [(2, 10.0 * (i + 1), 1.0, 0.5, min(i, 3)) for i in range(5)]
    starts = {mode: _start(mode, 1.0, rows) for mode in ("blocking", "eager_first", "eager")}
    path = eager_first.plot(starts, str(tmp_path / "t.png"), 5, "tiny")
    assert os.path.getsize(path) > 1000


def test_summary_takes_each_modes_median_first_step_over_its_repeats():
    rows = [(2, 10.0, 10.0, 0.0, 0)]
    starts = {mode: _start(mode, 1.0, rows) for mode in ("blocking", "eager_first", "eager")}
    repeats = {
        "eager_first": [{"first_step_ms": 30.0}, {"first_step_ms": 12.0}],  # with 10: median 12
        "eager": [{"first_step_ms": 8.0}, {"first_step_ms": 50.0}],  # with 10: median 10
    }
    result = eager_first.summary(starts, repeats)
    assert result["first_steps_ms"] == {"eager_first": [10.0, 30.0, 12.0], "eager": [10.0, 8.0, 50.0]}
    assert result["first_step_ratio"] == pytest.approx(12.0 / 10.0)


def _args(*argv):
    args = eager_first._parser().parse_args(list(argv))
    args.steps_cap = 1000
    return args


def test_a_start_settles_the_heap_before_t0_and_splits_its_first_step(monkeypatch):
    # Every start collects and freezes the Python heap before capture() (t = 0), so no
    # start's first step pays a collection its startup left; the first step's phases and
    # the graph-only state at t = 0 come back with the timeline.
    import gc

    from cuda_graph_runner.backend import pool
    from cuda_graph_runner.runner import DecodeCudaGraphRunner

    # Pools and capture streams are per process: start from none, as a benchmark start does,
    # whatever earlier tests in this worker left.
    monkeypatch.setattr(pool, "_pools", {})
    monkeypatch.setattr(pool, "_mem_pools", {})
    monkeypatch.setattr(pool, "_streams", {})
    events = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: events.append("collect") or collect(*a))
    monkeypatch.setattr(gc, "freeze", lambda: events.append("freeze"))  # recorded, not frozen
    capture = DecodeCudaGraphRunner.capture
    monkeypatch.setattr(
        DecodeCudaGraphRunner, "capture", lambda self, *a: events.append("capture") or capture(self, *a)
    )
    args = _args("--max-bs", "4", "--live-sizes", "1", "2", "3", "--steps", "3", "--budget-ms", "1000")
    args.one = "eager_first"
    out = eager_first._start(args)
    assert events.index("collect") < events.index("freeze") < events.index("capture")
    phases = out["phases"]
    at_t0 = phases["at_t0"]  # static buffers exist; no pool, stream or graph yet
    assert (at_t0["pool"], at_t0["capture_stream"], at_t0["graphs"]) == (False, False, 0)
    assert phases["at_t0"]["static_buffer_bytes"] > 0
    first = phases["first_step_ms"]
    assert set(first) == {"capture_call", "decide", "forward", "after", "sync", "gc", "total"}
    assert first["forward"] > 0 and first["total"] == pytest.approx(out["first_step_ms"])
    assert first["total"] >= first["capture_call"] + first["decide"] + first["forward"]
    assert {"model", "runner", "prefill", "gc", "frozen_objects", "modules"} <= set(phases["setup_ms"])
    assert out["full_speed_ms"] is not None and out["timeline"][-1]["ready"] == out["sizes"]
    # the probe took its collector callback with it
    assert not any(isinstance(getattr(cb, "__self__", None), eager_first.FirstStepProbe) for cb in gc.callbacks)


def test_first_step_only_start_stops_after_one_step_without_capturing():
    args = _args("--max-bs", "4", "--live-sizes", "1", "2")
    args.one, args.first_step_only = "eager_first", True
    out = eager_first._start(args)
    assert len(out["timeline"]) == 1 and out["timeline"][0]["capture_ms"] == 0.0 and out["replays"] == 0


def test_fresh_starts_get_empty_cache_folders_of_their_own(tmp_path):
    env = eager_first.start_env("fresh", str(tmp_path))
    assert {env[var] for var in eager_first.CACHE_VARS} == {str(tmp_path / s) for s in eager_first.CACHE_VARS.values()}
    assert eager_first.start_env("shared", str(tmp_path)) == dict(os.environ)


def test_time_limit_stops_a_start_and_names_it(tmp_path):
    import time

    # A start that printed a line, left a worker in its process group, and hangs.
    pid_file = tmp_path / "worker.pid"
    script = (
        "import subprocess, sys, time; w = subprocess.Popen(['sleep', '600']); "
        f"open({str(pid_file)!r}, 'w').write(str(w.pid)); print('started', flush=True); "
        "print('still going', file=sys.stderr, flush=True); time.sleep(30)"
    )
    sleeper = [sys.executable, "-c", script]
    began = time.monotonic()
    with pytest.raises(eager_first.TimeLimitError, match=r"the eager start was stopped by --time-limit-s") as exc:
        eager_first._run_one(sleeper, "eager", 0.0, deadline=time.monotonic() + 3.0)
    assert time.monotonic() - began < 20
    # Its output so far is text in the message (no b'...'), and its worker died with it.
    message = str(exc.value)
    assert "started" in message and "still going" in message and "b'" not in message
    worker = int(pid_file.read_text())
    end = time.monotonic() + 10
    while not _gone(worker) and time.monotonic() < end:
        time.sleep(0.05)
    assert _gone(worker), "the start's worker outlived the time limit"


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie not yet reaped
    except FileNotFoundError:
        return True


def test_stream_text_decodes_bytes():
    assert eager_first._text(b"caf\xc3\xa9 \xff") == "caf\u00e9 \ufffd"
    assert eager_first._text("text") == "text" and eager_first._text(None) == ""


def test_the_time_limit_is_finite_by_default(capsys):
    assert eager_first._parser().parse_args([]).time_limit_s == eager_first.DEFAULT_TIME_LIMIT_S == 600.0
    with pytest.raises(SystemExit):
        eager_first._parser().parse_args(["--help"])
    assert "default 600 s" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--until", "0.5"], "--until 0.5: must be >= 1"),
        (["--first-step-repeats", "0"], "--first-step-repeats 0: must be >= 1"),
        (["--time-limit-s", "0"], "--time-limit-s 0.0: must be a finite number of seconds > 0"),
        (["--time-limit-s", "nan"], "--time-limit-s nan: must be a finite number of seconds > 0"),
        (["--time-limit-s", "inf"], "--time-limit-s inf: must be a finite number of seconds > 0"),
    ],
)
def test_bad_run_options_are_refused_naming_the_value(argv, message, capsys):
    assert eager_first.main(argv) == 2
    assert message in capsys.readouterr().err


def _cpu_example() -> list:
    """The CPU example of the module docstring, as its arguments (the command's own words
    dropped)."""
    import shlex

    (line,) = [ln for ln in eager_first.__doc__.splitlines() if ln.rstrip().endswith("# CPU, fake graphs")]
    words = shlex.split(line.split("#")[0])
    assert words[:2] == ["python", "benchmarks/eager_first.py"]
    return words[2:]


def test_the_cpu_example_s_default_live_sizes_are_those_up_to_max_bs(monkeypatch):
    # The example as written: every default live size above its --max-bs 16 is left out.
    seen = {}

    def run_one(me, mode, until_s, **kwargs):
        seen[mode] = me
        raise RuntimeError("stop here: the options were accepted")

    monkeypatch.setattr(eager_first, "_run_one", run_one)
    assert eager_first.main(_cpu_example()) == 1
    me = seen["blocking"]
    assert me[me.index("--live-sizes") + 1 :] == ["1", "2", "3", "5", "8", "13"]
    assert me[me.index("--max-bs") + 1] == "16"


def test_live_sizes_given_must_lie_within_max_bs(capsys):
    assert eager_first.main(["--max-bs", "16", "--live-sizes", "1", "32"]) == 2
    assert "--live-sizes [1, 32] must lie in 1..--max-bs 16" in capsys.readouterr().err
    assert eager_first.main(["--max-bs", "0"]) == 2
    assert "--max-bs 0: must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message, accepted",
    [
        (["--backend", "nope"], "--backend 'nope': accepted ", ["full", "full+torch_compile", "tc_piecewise:inductor"]),
        (["--backend", "full:eager"], "--backend 'full:eager': accepted ", ["full", "full+torch_compile"]),
        (["--dtype", "float99"], "--dtype 'float99': accepted ", ["float32", "bfloat16", "float16"]),
        (["--model", "nope"], "--model 'nope': accepted ", ["tiny", "llama-3.2-1b"]),
        (["--device", "foo"], "--device 'foo': accepted ", ["cpu", "cuda", "cuda:N"]),
        (["--device", "cuda:x"], "--device 'cuda:x': accepted ", ["cpu", "cuda", "cuda:N"]),
        (["--device", "meta"], "--device 'meta': accepted ", ["cpu", "cuda", "cuda:N"]),
    ],
)
def test_bad_choices_are_refused_in_one_line_naming_the_value(argv, message, accepted, capsys):
    assert eager_first.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert "Traceback" not in err
    assert all(a in err.split("accepted ", 1)[1].rstrip().split(", ") for a in accepted), err


def _refused(argv, capsys) -> str:
    """The one error line ``main`` gives for ``argv``, no start run (any start fails the test)."""
    assert eager_first.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


def test_cuda_is_refused_up_front_where_no_cuda_device_is(monkeypatch, capsys):
    import torch

    def no_start(*args, **kwargs):
        raise AssertionError("a start ran")

    monkeypatch.setattr(eager_first, "_run_one", no_start)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:0"):
        err = _refused(["--device", device], capsys)
        assert f"--device {device!r}: no CUDA device here; accepted cpu" in err, err
    # With one CUDA device, an index past it is named with the devices there are.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    err = _refused(["--device", "cuda:3"], capsys)
    assert "--device 'cuda:3': 1 CUDA device(s) here; accepted cpu, cuda, cuda:0" in err, err
    assert eager_first.device_problem("cuda:0") is None and eager_first.device_problem("cpu") is None
