"""``benchmarks/dp_agreement.py``: its option checks, the check that each timed step made
each patched call exactly once, and a whole run on the CPU (2 gloo ranks, the smallest
budget; bounded by ``--timeout-s``, which kills every rank at the deadline). No timing is
asserted."""

from __future__ import annotations

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import dp_agreement  # noqa: E402

#: Every per-rank measure the JSON gives.
RANK_KEYS = {
    "rank", "live_bs", "rounds", "steps", "floor_us", "floor5_us", "agree_us", "host_us", "build_us", "block_us",
    "start_us", "issue_us", "issue_preempted", "wait_us", "overlap_us", "step_ms", "step_total_blocking_ms",
    "step_total_overlapped_ms", "replays", "fallbacks", "phases_s", "share_blocking", "share_overlapped",
    "share_blocking_ref", "share_overlapped_ref",
}  # fmt: skip


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preset", "no-such-model"], "--preset 'no-such-model': accepted "),
        (["--budget-s", "0.5"], "--budget-s 0.5: accepted 1 to 300 seconds"),
        (["--timeout-s", "nan"], "--timeout-s nan: accepted a finite number of seconds > 0"),
        (["--timeout-s", "0"], "--timeout-s 0.0: accepted a finite number of seconds > 0"),
    ],
)
def test_bad_options_are_refused_before_any_rank_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        dp_agreement.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    if argv[0] == "--preset":
        assert "tiny" in err  # the presets are listed


def test_a_step_must_record_exactly_one_of_each_timing():
    records = {"issues": [1.0, 2.0], "waits": [3.0]}
    dp_agreement._grew_by_one("overlapped", records, {"issues": 1, "waits": 0})  # one each: fine
    with pytest.raises(RuntimeError, match=r"the overlapped step recorded waits \+0 \(expected exactly one of each\)"):
        dp_agreement._grew_by_one("overlapped", records, {"issues": 1, "waits": 1})
    with pytest.raises(RuntimeError, match=r"the blocking step recorded blocks \+2"):
        dp_agreement._grew_by_one("blocking", {"blocks": [1.0, 2.0]}, {"blocks": 0})


def test_two_gloo_ranks_run_the_whole_benchmark(tmp_path, capsys):
    path = tmp_path / "dp.json"
    argv = ["--dp", "2", "--bs", "2", "--budget-s", "1", "--timeout-s", "150", "--json", str(path)]
    assert dp_agreement.main(argv) == 0
    doc = json.loads(path.read_text())
    assert doc["dp"] == 2 and doc["preset"] == "tiny" and doc["budget_s"] == 1.0
    ranks = doc["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert [r["live_bs"] for r in ranks] == [2, 1]  # rank 0's bs, the others half
    for r in ranks:
        assert set(r) == RANK_KEYS, set(r) ^ RANK_KEYS
        assert r["fallbacks"] == 0
        assert r["replays"] > 0
        assert r["overlap_us"] > 0 and r["block_us"] > 0
    # The counts are agreed: the calls are collectives, every rank makes as many.
    assert ranks[0]["steps"] == ranks[1]["steps"] >= 10
    assert ranks[0]["rounds"] == ranks[1]["rounds"] >= 50
    assert f"{ranks[0]['steps']} steps per arm" in capsys.readouterr().out


def test_help_gives_the_first_paragraph_and_every_printed_column(capsys):
    import inspect
    import re

    with pytest.raises(SystemExit) as exc:
        dp_agreement.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    out = " ".join(text.split())  # the description's line breaks as spaces
    first = " ".join(dp_agreement.__doc__.split("\n\n")[0].split())
    assert first.endswith(".") and first in out
    # Every column header the tables print (the ``{'name':>width}`` fields of main), and
    # the trailing one.
    columns = set(re.findall(r"\{'([^']+)':>\d+\}", inspect.getsource(dp_agreement.main))) | {"phases s"}
    assert {"floor µs", "overlap µs", "step ms", "blocking@ref", "build+step ms b/o"} <= columns
    # Each is explained on a line of the epilog that starts with its name.
    terms = [line.strip() for line in text.split("columns of the first table", 1)[1].splitlines()]
    missing = {name for name in columns if not any(t.startswith(name + " ") or t == name for t in terms)}
    assert not missing, missing
