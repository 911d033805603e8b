"""benchmarks/isolation_ab.py: which phases an arm times, how wave 2 is fitted into the
time left, and the whole harness end to end on the CPU (the tiny preset, the compiled
methods as Dynamo-eager stand-ins; no timing is asserted)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import isolation_ab as ab  # noqa: E402


def test_phases_follow_what_the_arm_built():
    assert ab.ARMS["alone"].phases() == ["pair"]
    assert ab.ARMS["beside_both"].phases() == ["all", "pair", "trees_freed", "others_freed"]
    assert ab.ARMS["beside_ro"].phases() == ["all", "pair", "trees_freed"]
    assert ab.ARMS["beside_full"].phases() == ["all", "pair", "others_freed"]
    assert ab.ARMS["beside_both_reset"].phases() == ["pair"]  # the others' code is gone after the reset
    assert ab.ARMS["beside_both_no_trees"].phases() == ["all", "pair", "others_freed"]
    assert set(ab.DEFAULT_ARMS) <= set(ab.ARMS)
    # The cold builds share wave 1; wave 2 rebuilds on the cache wave 1 warmed.
    assert [n for n in ab.DEFAULT_ARMS if ab.ARMS[n].wave == 1] == ["alone", "beside_both", "beside_both_no_trees"]
    assert all(not ab.ARMS[n].cold() for n in ab.DEFAULT_ARMS if ab.ARMS[n].wave == 2)


def test_wave_2_takes_the_arms_that_fit_in_order():
    wave1 = {
        "alone": {"build_total_s": 30.0, "timing_s": 4.0, "phases": {"pair": {}}},
        "beside_both": {"build_total_s": 150.0, "timing_s": 20.0, "phases": dict.fromkeys("abcd", {})},
    }
    # 5 s per phase (the larger of 4/1 and 20/4); warm builds half of wave 1's, a cold one all of it.
    chosen, reserves, skipped = ab.plan_wave_2(["beside_ro", "alone_again", "beside_both_no_trees"], wave1, 200.0, 25.0)
    assert chosen == ["beside_ro", "alone_again"]
    assert reserves == {"beside_ro": 3 * 5.0 + 5, "alone_again": 5.0 + 5}
    # no_trees misses the warm cache: 150 s build + 20 + 10 + 20 s timing + 15 s margin > 200 s.
    assert list(skipped) == ["beside_both_no_trees"]
    assert "215 s needed" in skipped["beside_both_no_trees"]
    chosen, _, skipped = ab.plan_wave_2(["beside_both_no_trees"], wave1, 300.0, 25.0)
    assert chosen == ["beside_both_no_trees"] and not skipped
    # Nothing built in wave 1: half the time left is assumed per build, the default reserve per child.
    chosen, reserves, _ = ab.plan_wave_2(["alone_again"], {}, 100.0, 25.0)
    assert chosen == ["alone_again"] and reserves == {"alone_again": 25.0}


def test_limit_hits_counts_dynamo_s_recompile_limit_warning():
    import logging

    hits = ab.LimitHits()
    logger = logging.getLogger("torch._dynamo.test_isolation_ab")
    logger.addHandler(hits)
    try:
        for _ in range(2):
            logger.warning(
                "torch._dynamo hit config.%s (%s)\n   function: %s\n   last reason: %s",
                "recompile_limit",
                8,
                "'step'",
                "x",
            )
        logger.warning("an unrelated warning")
    finally:
        logger.removeHandler(hits)
    assert hits.hits == {"recompile_limit in 'step'": 2}


def test_cpu_smoke_builds_times_and_probes(tmp_path, capsys):
    # One arm at one size keeps it to one child process (its imports dominate the time).
    out = tmp_path / "iso"
    argv = ["--device", "cpu", "--arms", "beside_ro", "--batch-sizes", "1", "--rounds", "1", "--iters", "1"]
    argv += ["--warmup-max", "2", "--warmup-min-s", "0", "--budget-s", "150", "--out", str(out)]
    assert ab.main(argv) == 0
    doc = json.loads((out / "isolation_ab.json").read_text())
    assert list(doc["variants"]) == ["beside_ro"]
    ro = doc["variants"]["beside_ro"]
    assert ro["status"] == "done", ro.get("log_tail")
    assert list(ro["phases"]) == ["all", "pair", "trees_freed"]
    assert ro["phases"]["all"]["methods"] == sorted(["hand_graph", ab.RO, ab.TC])
    assert ro["phases"]["pair"]["methods"] == ["hand_graph", ab.TC]
    for phase in ro["phases"].values():
        assert list(phase["by_bs"]) == ["1"]
        assert phase["by_bs"]["1"]["ratio_tc_hand"]["median"] > 0
    # One Dynamo entry on the stand-in's step code per size; no recompile limit hit.
    assert ro["after_others"]["cache_entries"]["reduce_overhead.step"] == 1
    assert ro["after_others"]["counters"]["stats"]["unique_graphs"] == 1
    assert ro["after_tc"]["recompile_limit_hits"] == {}
    assert ro["after_tc"]["recompile_limits"]["recompile_limit"] == ro["recompile_limits"]["recompile_limit"]
    text = (out / "isolation_ab.txt").read_text()
    assert "| beside_ro | trees_freed |" in text and f"| beside_ro | {ro['build_total_s']} |" in text
    assert text in capsys.readouterr().out


def test_scrub_makes_every_absolute_path_portable(tmp_path):
    line = f"{tmp_path}/site-packages/torch/x.py:12: UserWarning: see (/opt/cache/inductor), 1/2 of core/a.py"
    out = ab.scrub(line)
    assert "/opt/" not in out and str(tmp_path) not in out
    assert out.endswith(":12: UserWarning: see (<abs>/inductor), 1/2 of core/a.py")


def test_a_phase_with_nothing_measured_is_neither_steady_nor_unsteady():
    row = {
        ab.TC: {"median_ms": 2.0, "steady": False},
        "hand_graph": {"median_ms": 1.0, "steady": True},
        "ratio_tc_hand": {"median": 2.0, "lo": 1.9, "hi": 2.1},
    }
    results = {"a": {"status": "done", "phases": {"pair": {"by_bs": {}}, "all": {"by_bs": {"1": row}}}}}
    lines = ab.tables(results, [1]).splitlines()
    assert "| a | pair | - | - |" in lines
    assert "| a | all | 2.000 [1.900-2.100] (2.000/1.000) | no |" in lines


@pytest.mark.parametrize(
    "argv, flag, value",
    [
        (["--budget-s", "0"], "--budget-s", "0.0"),
        (["--budget-s", "nan"], "--budget-s", "nan"),
        (["--timing-reserve-s", "-1"], "--timing-reserve-s", "-1.0"),
        (["--timing-reserve-s", "nan"], "--timing-reserve-s", "nan"),
        (["--batch-sizes", "1", "0"], "--batch-sizes", "0"),
        (["--batch-sizes", str(ab.MAX_BS + 1)], "--batch-sizes", str(ab.MAX_BS + 1)),
        (["--model", "nope"], "--model", "'nope'"),
        (["--warmup-max", "-1"], "--warmup-max", "-1"),
        (["--warmup-max", "1"], "--warmup-max", "1"),
        (["--warmup-min-s", "-0.5"], "--warmup-min-s", "-0.5"),
        (["--warmup-min-s", "nan"], "--warmup-min-s", "nan"),
        (["--warmup-min-s", "inf"], "--warmup-min-s", "inf"),
        (["--prompt-len", "0"], "--prompt-len", "0"),
    ],
)
def test_bad_input_is_refused_before_any_child_starts(tmp_path, capsys, argv, flag, value):
    with pytest.raises(SystemExit) as exc:
        ab.main(["--device", "cpu", "--out", str(tmp_path / "iso"), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag} {value}: accepted" in err and "Traceback" not in err
    assert not (tmp_path / "iso").exists()


def test_a_child_knows_when_its_deadline_passed_or_its_parent_is_gone():
    assert ab.orphaned(time.time() + 60, os.getppid()) is None
    assert ab.orphaned(None, None) is None
    assert "deadline passed" in ab.orphaned(time.time() - 1, os.getppid())
    # This process's parent is os.getppid(): any other pid reads as a parent gone.
    assert "parent 1 is gone" in ab.orphaned(time.time() + 60, 1)


def _child_argv(tmp_path, deadline: float, parent_pid: int) -> list:
    return [
        *(sys.executable, os.path.join(BENCH, "isolation_ab.py"), "--child", "alone", "--device", "cpu"),
        *("--json", str(tmp_path / "alone.json"), "--sync-dir", str(tmp_path)),
        *("--deadline", repr(deadline), "--parent-pid", str(parent_pid)),
    ]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie not yet reaped
    except FileNotFoundError:
        return True


def test_a_child_past_its_deadline_exits_at_once(tmp_path):
    argv = _child_argv(tmp_path, time.time() - 1, os.getpid())
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == ab.ORPHAN_EXIT, done.stderr
    assert "leaves: its deadline passed" in done.stderr
    assert not (tmp_path / "alone.ready").exists()  # it left before building anything


def test_a_child_whose_parent_is_gone_exits(tmp_path):
    # A middle process starts the child (its own session, as the parent does) and exits
    # at once: the child, far from its deadline, must notice it was handed to another parent.
    argv = _child_argv(tmp_path, time.time() + 600, 0)
    script = (
        "import os, subprocess, sys; argv = sys.argv[1:]; argv[argv.index('--parent-pid') + 1] = str(os.getpid()); "
        "print(subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL, "
        "stderr=subprocess.DEVNULL).pid, flush=True)"
    )
    middle = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=60)
    assert middle.returncode == 0, middle.stderr
    pid = int(middle.stdout.strip())
    try:
        end = time.monotonic() + 30
        while not _gone(pid) and time.monotonic() < end:
            time.sleep(0.1)
        assert _gone(pid), f"child {pid} still running 30 s after its parent exited"
    finally:
        if not _gone(pid):
            os.killpg(pid, signal.SIGKILL)
    assert not (tmp_path / "alone.ready").exists()


def test_sigterm_to_the_parent_kills_every_child_s_process_group(tmp_path, monkeypatch):
    procs = []
    grandchild = tmp_path / "grandchild.pid"

    def parent(args, spawned):
        # A stand-in child: a session of its own with a grandchild in its group, as the
        # compile workers are; then the parent is sent SIGTERM mid-run.
        script = (
            "import subprocess, sys, time; p = subprocess.Popen(['sleep', '600']); "
            "open(sys.argv[1], 'w').write(str(p.pid)); time.sleep(600)"
        )
        child = ab.Child.__new__(ab.Child)
        child.proc = subprocess.Popen([sys.executable, "-c", script, str(grandchild)], start_new_session=True)
        child.logf = open(tmp_path / "child.log", "w")
        spawned.append(child)
        procs.append(child.proc)
        end = time.monotonic() + 30
        while not (grandchild.exists() and grandchild.read_text()) and time.monotonic() < end:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler raises before this ends
        return 0

    monkeypatch.setattr(ab, "parent", parent)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exc:
        ab.main(["--device", "cpu", "--out", str(tmp_path / "iso")])
    assert exc.value.code == 128 + signal.SIGTERM
    assert procs[0].poll() == -signal.SIGKILL
    gpid = int(grandchild.read_text())
    end = time.monotonic() + 10
    while not _gone(gpid) and time.monotonic() < end:
        time.sleep(0.05)
    assert _gone(gpid), "the child's group outlived the parent"
    assert signal.getsignal(signal.SIGTERM) is before


def _resolved(tmp_path, monkeypatch, *argv):
    """The options ``main`` hands the parent (which starts no child here)."""
    seen = []

    def parent(args, spawned):
        seen.append(args)
        return 0

    monkeypatch.setattr(ab, "parent", parent)
    assert ab.main([*argv, "--out", str(tmp_path / "iso")]) == 0
    return seen[0]


def _defaults(args):
    return {key: getattr(args, key) for key in ab.DEVICE_DEFAULTS["cpu"]}


def test_cpu_defaults_are_a_smoke_s_and_cuda_s_a_measurement_s(tmp_path, monkeypatch):
    cpu = _defaults(_resolved(tmp_path, monkeypatch, "--device", "cpu"))
    cuda = _defaults(_resolved(tmp_path, monkeypatch))  # --device cuda is the default
    assert cpu == ab.DEVICE_DEFAULTS["cpu"] and cuda == ab.DEVICE_DEFAULTS["cuda"]
    assert set(ab.DEVICE_DEFAULTS["cpu"]) == set(ab.DEVICE_DEFAULTS["cuda"])
    # The smoke: the tiny preset, one arm per wave, fewer timed calls, a minute's budget.
    assert cpu["model"] == "tiny" and [ab.ARMS[n].wave for n in cpu["arms"]] == [1, 2]
    assert cpu["rounds"] * cpu["iters"] < cuda["rounds"] * cuda["iters"] and cpu["budget_s"] <= 60
    # The measurement: every arm, the model the results were taken on.
    assert cuda["arms"] == ab.DEFAULT_ARMS and cuda["model"] == "llama-3.2-1b"
    # An option given replaces its default only.
    given = _defaults(_resolved(tmp_path, monkeypatch, "--device", "cpu", "--rounds", "3", "--budget-s", "90"))
    assert given == {**cpu, "rounds": 3, "budget_s": 90.0}


def test_help_gives_both_devices_defaults(capsys):
    with pytest.raises(SystemExit) as exc:
        ab.main(["--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "cpu: a smoke of the harness (well under a minute)" in out
    for shown in ("(default 5; cpu: 1)", "(default 20; cpu: 1)", "(default 390; cpu: 60)", "cpu: alone beside_ro)"):
        assert shown in out, shown


def test_the_model_must_be_a_reference_preset_and_the_accepted_are_named(tmp_path, capsys):
    from cuda_graph_runner.reference.model import PRESETS

    with pytest.raises(SystemExit) as exc:
        ab.main(["--device", "cpu", "--model", "nope", "--out", str(tmp_path / "iso")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert all(name in err.split("accepted", 1)[1] for name in PRESETS), err


def _failing_children(monkeypatch, code: str) -> list:
    """Every child the parent starts runs ``code`` instead of the arm (its command line
    recorded): no build, no timing."""
    popen = subprocess.Popen
    cmds = []

    def start(cmd, **kwargs):
        cmds.append(cmd)
        return popen([sys.executable, "-c", code], **kwargs)

    monkeypatch.setattr(ab.subprocess, "Popen", start)
    return cmds


def test_an_arm_that_fails_reports_nothing_of_a_stale_json_and_no_arm_done_fails_the_run(tmp_path, monkeypatch, capsys):
    out = tmp_path / "iso"
    (out / "arms").mkdir(parents=True)
    stale = {"phases": {"pair": {"by_bs": {"1": {}}}}, "build_total_s": 12.5, "after_tc": {}}
    for path in (out / "arms" / "alone.json", out / "arms" / "alone.json.tmp"):
        path.write_text(json.dumps(stale))
    cmds = _failing_children(monkeypatch, "raise SystemExit(1)")
    code = ab.main(["--device", "cpu", "--arms", "alone", "--budget-s", "30", "--out", str(out)])
    assert len(cmds) == 1
    alone = json.loads((out / "isolation_ab.json").read_text())["variants"]["alone"]
    assert alone["status"] == "exited 1 while building"
    assert not {"phases", "build_total_s", "after_tc"} & set(alone), alone
    assert not (out / "arms" / "alone.json").exists() and not (out / "arms" / "alone.json.tmp").exists()
    assert "| alone | 12.5 |" not in (out / "isolation_ab.txt").read_text()
    assert code == 1
    err = capsys.readouterr().err
    assert "no arm finished (alone: exited 1 while building)" in err, err
