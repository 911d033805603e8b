"""CPU smoke runs of benchmarks/speculative.py (the tiny preset, emulated graphs): each row
is lossless, carries the verify output it ran (greedy tokens by default, logits with
``--logits-verify``) and host times that follow from its own runs. No timing is asserted."""

from __future__ import annotations

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

pytest.importorskip("cuda_graph_runner_breakable.emulation")
pytest.importorskip("cuda_graph_runner_full.backend")

import speculative  # noqa: E402

ARGV = ["--device", "cpu", "--preset", "tiny", "--k", "2", "--batch-sizes", "2", "--new-tokens", "9"]


@pytest.mark.parametrize(("flag", "output"), [([], "tokens"), (["--logits-verify"], "logits")])
def test_rows_are_lossless_and_name_their_verify_output(tmp_path, capsys, flag, output):
    out = tmp_path / "spec.json"
    argv = [*ARGV, "--drafts", "oracle", "skip:1", "--repeats", "1", "--iters", "2", "--host-only", *flag]
    assert speculative.main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["draft"] for r in rows] == ["oracle", "skip:1"]
    for row in rows:
        assert row["lossless"] and row["divergence"] == ""
        assert row["verify_output"] == output
        assert 0.0 <= row["loop_host_share"] < 1.0 and row["rounds"] >= 1
        assert 0.0 < row["host_only_share"] < 1.0
        phases = row["host_only_phase_us"]
        assert set(phases) == {"propose", "batch", "read_accept"}
        assert sum(phases.values()) == pytest.approx(row["host_only_us_per_round"])
    # The oracle proposes plain greedy's own tokens; past them it pads with token 0, which
    # this run never proposes: 8 tokens after the first, 3 committed per verify (k + 1),
    # and the last verify needs 2 of its k proposals, both known.
    assert rows[0]["accept_rate"] == 1.0
    captured = capsys.readouterr()
    assert f"verify={output}" in captured.out and "lossless" in captured.out
    assert "emulated graphs" in captured.err  # CPU rows are the mechanism, not a speed


def test_both_verify_flags_are_refused(capsys):
    with pytest.raises(SystemExit):
        speculative.main([*ARGV, "--greedy-verify", "--logits-verify"])
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--k", "4", "0"], "--k 0: takes ints >= 1"),
        (["--batch-sizes", "-1"], "--batch-sizes -1: takes ints >= 1"),
        (["--new-tokens", "1"], "--new-tokens 1: takes an int >= 2"),
        (["--drafts", "oracle", "nosuch"], "--drafts nosuch: not a draft; accepted: oracle, self, skip:N (N in 1..2"),
        (["--drafts", "skip:9"], "--drafts skip:9: not a draft"),
        (["--drafts", "skip:x"], "--drafts skip:x: not a draft"),
        (["--preset", "llama-9"], "argument --preset: invalid choice: 'llama-9'"),
        (["--prompt-len", "0"], "--prompt-len 0: takes ints >= 1"),
        (["--repeats", "0"], "--repeats 0: takes ints >= 1"),
        (["--device", "gpu0"], "--device 'gpu0': not a device; accepted: cuda, cuda:N, cpu"),
    ],
)
def test_bad_input_is_refused_naming_the_value(capsys, argv, message):
    with pytest.raises(SystemExit):
        speculative.main(["--device", "cpu", *argv])
    assert message in capsys.readouterr().err
