"""Progress display: terminal only, each finished step leaves one summary line."""

from __future__ import annotations

from cuda_graph_runner.backend import progress


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


def test_library_bars_are_off_in_a_pipe_and_back_after(capsys):
    import io

    from tqdm.auto import tqdm

    with progress.library_bars(None):  # stderr is not a terminal under pytest
        list(tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."))
        list(tqdm(range(3), desc="given a file", file=io.StringIO()))
    assert "Converting" not in capsys.readouterr().err
    after = io.StringIO()
    list(tqdm(range(3), desc="drawn again", file=after))
    assert "drawn again" in after.getvalue()
    with progress.library_bars(True):  # a terminal (or show=True): the library's bars stay
        list(tqdm(range(3), desc="on a terminal"))
    assert "on a terminal" in capsys.readouterr().err


def test_preparing_a_real_model_draws_no_library_bar_into_a_log(tmp_path, monkeypatch, capfd):
    """transformers' GGUF conversion draws a ``tqdm.auto`` bar of its own, which its
    ``disable_progress_bar`` does not reach; prepare() run into a log file shows none."""
    import pytest

    transformers = pytest.importorskip("transformers", reason="prepare() drives transformers (the smollm2 extra)")
    import types

    import torch
    from tqdm.auto import tqdm

    from cuda_graph_runner.reference import real_model

    spec = real_model.REAL_MODELS["smollm2-135m"]
    monkeypatch.setattr(real_model, "check_available", lambda name: spec)
    monkeypatch.setattr(real_model, "gguf_file", lambda s: str(tmp_path / "model.gguf"))

    class Tokenizer:
        def save_pretrained(self, path):
            open(f"{path}/tokenizer.json", "w").write("{}")

    def model_from_gguf(*args, **kwargs):
        for _ in tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):  # as transformers does
            pass
        config = types.SimpleNamespace(to_dict=lambda: {"tie_word_embeddings": False})
        return types.SimpleNamespace(config=config, state_dict=lambda: {"w": torch.zeros(2)})

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: Tokenizer())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model_from_gguf)
    path = real_model.prepare("smollm2-135m", root=str(tmp_path / "cache"), show_progress=None)
    assert sorted(p.name for p in (tmp_path / "cache" / "smollm2-135m").iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert path.endswith("smollm2-135m")
    err = capfd.readouterr().err
    assert "Converting" not in err and "preparing" not in err, err
