"""The bench's CPU thread count (cuda_graph_runner.cli.bench.cpu_threads): the same in every start
on a machine, the flag and the thread variables win, and the bench says which it used."""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.cli.bench.cpu_threads import choose_threads, default_threads
from cuda_graph_runner.cli.command import main


@pytest.mark.parametrize("cpus, threads", [(1, 1), (2, 1), (3, 1), (4, 2), (16, 8)])
def test_the_default_is_half_the_cpus_whatever_the_load(cpus, threads):
    assert default_threads(cpus) == threads
    got, why = choose_threads(None, current=cpus, cpus=cpus, environ={})
    assert got == threads and f"half of {cpus} CPUs" in why and "--threads N" in why


def test_the_flag_wins_then_a_thread_variable_keeps_torchs_count():
    assert choose_threads(3, current=2, cpus=2, environ={"OMP_NUM_THREADS": "1"}) == (3, "--threads")
    assert choose_threads(None, current=2, cpus=2, environ={"OMP_NUM_THREADS": "2"}) == (2, "OMP_NUM_THREADS")
    assert choose_threads(None, current=5, cpus=8, environ={"MKL_NUM_THREADS": "5"}) == (5, "MKL_NUM_THREADS")
    assert choose_threads(None, current=2, cpus=2, environ={"OMP_NUM_THREADS": " "})[0] == 1  # blank: not set
    with pytest.raises(ValueError, match=r"--threads 0: accepted: an integer >= 1"):
        choose_threads(0, current=2)


@pytest.mark.parametrize("value", ["0", "-1", "two", "\u0662", "1_0"])
def test_a_bad_thread_count_is_refused_before_any_work(value, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--threads", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--threads: invalid value {value!r}; accepted: an integer >= 1 (digits 0-9)" in err, err


def test_the_bench_says_its_threads_runs_with_them_and_gives_torchs_back(capsys, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    seen = []
    from cuda_graph_runner.cli.bench import command as bench

    real = bench.bench_decode

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "bench_decode", spy)
    code = main(
        ["bench", "--device", "cpu", "--threads", "1", "--decode-backends", "disabled", "--no-prefill"]
        + ["--batch-sizes", "1", "--steps", "1", "--iters", "1", "--warmup", "0", "--prompt-len", "4"]
    )
    out = capsys.readouterr().out
    assert code == 0 and seen == [1], (code, seen, out)
    assert "threads: 1 intra-op (--threads)" in out
    assert torch.get_num_threads() == before
