"""Progress display: terminal only, each finished step leaves one summary line."""

from __future__ import annotations

from cuda_graph_runner import progress


def test_bar_leaves_one_summary_line_when_shown(capsys):
    assert list(progress.bar([3, 2, 1], desc="capture decode (x)", done="captured 3 decode graphs (x)", show=True)) == [
        3,
        2,
        1,
    ]
    err = capsys.readouterr().err
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith("captured 3 decode graphs (x) in ") and last.endswith(" s")


def test_nothing_is_drawn_off_a_terminal(capsys):
    # Under pytest stderr is not a TTY: show=None means off.
    assert list(progress.bar(range(3), desc="d", done="done")) == [0, 1, 2]
    with progress.step("prepare", "prepared", None):
        pass
    assert capsys.readouterr().err == ""


def test_a_quick_step_leaves_no_line_a_slow_one_its_time(capsys, monkeypatch):
    with progress.step("prepare decode (x)", "prepared decode (x)", True):
        pass
    assert "prepared" not in capsys.readouterr().err
    monkeypatch.setattr(progress, "QUIET_BELOW_S", -1.0)
    with progress.step("prepare decode (x)", "prepared decode (x)", True):
        pass
    assert "prepared decode (x) in " in capsys.readouterr().err


def test_a_failing_step_clears_its_line_and_never_says_done(capsys):
    import pytest

    with pytest.raises(RuntimeError, match="boom"):
        with progress.step("prepare decode (x)", "prepared decode (x)", True):
            raise RuntimeError("boom")
    err = capsys.readouterr().err
    assert "prepared" not in err
    # The last thing drawn blanks "prepare decode (x) ..." and returns to column 0.
    assert err.endswith(" " * len("prepare decode (x) ...") + "\r")


def test_a_failing_bar_never_says_done(capsys):
    import pytest

    def items():
        yield 1
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError, match="capture failed"):
        list(progress.bar(items(), desc="capture decode (x)", done="captured decode (x)", show=True))
    assert "captured decode (x) in" not in capsys.readouterr().err
