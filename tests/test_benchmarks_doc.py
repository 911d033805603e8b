"""docs/benchmarks.md against the stored results: the page's results are what
``benchmarks/make_docs.py --results`` renders from ``benchmarks/results/`` (the newest
folder of each kind), the store's folders follow its layout, and no stored file or page
carries a path of the machine that ran it. Torch-free; reads the committed files only.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
RESULTS = os.path.join(BENCH, "results")
DOC = os.path.join(ROOT, "docs", "benchmarks.md")
sys.path.insert(0, BENCH)

import make_docs  # noqa: E402
import make_docs_extra  # noqa: E402
from portable import portable_argv, portable_path  # noqa: E402

#: An absolute path of a machine (a home, temporary, install or output folder).
ABSOLUTE = re.compile(r"(?<![\w.<>~-])/(root|home|tmp|opt|usr|var|work|mnt|srv|data)/")
GPU_UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-")


def _stored_files():
    for base in (RESULTS, os.path.join(BENCH, "baseline")):
        for folder, _, names in os.walk(base):
            for name in names:
                yield os.path.join(folder, name)


def test_the_page_is_what_the_stored_results_give(capsys):
    with open(DOC) as f:
        doc = f.read()
    generated = make_docs.render_store(RESULTS)
    assert make_docs.splice(doc, generated) == doc, (
        "docs/benchmarks.md is stale: run python3 benchmarks/make_docs.py --results benchmarks/results"
    )
    assert make_docs.main(["--results", RESULTS, "--doc", DOC, "--check"]) == 0
    # Every kind the page shows comes from its newest folder, and each table says where from.
    for kind in ("decode", "decode-run-to-run", "compiled-full", "replay-prepare", "capture-warmup", "tp"):
        folder = make_docs_extra.newest(RESULTS, kind)
        assert folder and f"`{make_docs_extra.shown_path(folder)}" in generated, kind
    # Prefill: the newest main run (benchmarks.json) that timed a graph backend's prefill.
    assert f"`{make_docs_extra.shown_path(make_docs_extra.newest_with_prefill(RESULTS))}`" in generated
    assert len(doc.splitlines()) <= 340


def test_check_fails_on_a_stale_page(tmp_path, capsys):
    with open(DOC) as f:
        doc = f.read()
    stale = tmp_path / "benchmarks.md"
    stale.write_text(doc.replace("| 1 | full |", "| 1 | full (edited) |", 1))
    assert make_docs.main(["--results", RESULTS, "--doc", str(stale), "--check"]) == 1
    assert "differs" in capsys.readouterr().err
    assert make_docs.main(["--results", RESULTS, "--doc", str(stale)]) == 0
    assert stale.read_text() == doc
    assert make_docs.main(["--doc", str(stale)]) == 2  # neither JSON files nor --results


def test_newest_folder_per_kind_and_the_folder_layout(tmp_path, capsys):
    for name in ("2026-11-30-h200-decode", "2026-12-01-h200-decode", "2026-12-02-h200-tp", "notes.txt"):
        (tmp_path / name).mkdir() if name.endswith(("decode", "tp")) else (tmp_path / name).write_text("")
    assert make_docs_extra.newest(str(tmp_path), "decode").endswith("2026-12-01-h200-decode")
    assert make_docs_extra.newest(str(tmp_path), "variants") is None
    (tmp_path / "2026-12-03-h200-x2-session9-final").mkdir()
    with pytest.raises(ValueError, match=r"'2026-12-03-h200-x2-session9-final'.*DATE-GPU-CONTENT.*decode"):
        make_docs_extra.folders(str(tmp_path))
    assert make_docs.main(["--results", str(tmp_path), "--print"]) == 2
    assert "session9" in capsys.readouterr().err
    # The committed store follows the layout.
    assert {k for _, _, k, _ in make_docs_extra.folders(RESULTS)} <= set(make_docs_extra.KINDS)


def test_stored_output_holds_no_path_or_id_of_the_machine():
    bad = []
    for path in _stored_files():
        with open(path, errors="replace") as f:
            text = f.read()
        for pattern in (ABSOLUTE, GPU_UUID):
            m = pattern.search(text)
            if m:
                bad.append(f"{os.path.relpath(path, ROOT)}: {text[max(0, m.start() - 20) : m.end() + 30]!r}")
    assert not bad, "\n".join(bad)


def test_docs_carry_no_machine_path_or_development_narration():
    pages = [DOC, os.path.join(ROOT, "README.md"), os.path.join(ROOT, "CHANGELOG.md")]
    pages += [os.path.join(ROOT, "docs", n) for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md")]
    plugins = os.path.join(ROOT, "plugins")
    pages += [os.path.join(plugins, p, "README.md") for p in os.listdir(plugins)]
    narration = re.compile(
        r"\b(this|last|next|second|third) (round|session)\b|\bsession ?\d|\b[Ii]ssue \d+|nvidia-h200-x"
    )
    bad = []
    for page in sorted(set(p for p in pages if os.path.exists(p))):
        with open(page) as f:
            for n, line in enumerate(f, 1):
                m = ABSOLUTE.search(line) or narration.search(line)
                if m:
                    bad.append(f"{os.path.relpath(page, ROOT)}:{n}: {m.group(0)!r}")
    assert not bad, "\n".join(bad)


def test_portable_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert portable_path(str(tmp_path / "out" / "run.json")) == "out/run.json"
    assert portable_path("out/run.json") == "out/run.json"
    assert portable_path("/somewhere/else/cache") == "<abs>/cache"
    argv = portable_argv(["--out", str(tmp_path / "o"), f"--json={tmp_path}/t.json", "--models", "llama-3.2-1b"])
    assert argv == ["--out", "o", "--json=t.json", "--models", "llama-3.2-1b"]


def test_every_results_folder_named_in_docs_and_scripts_exists():
    named = re.compile(r"\b(\d{4}-\d{2}-\d{2}-[a-z0-9]+-[a-z0-9]+(?:-[a-z0-9]+)*)")
    files = [os.path.join(ROOT, n) for n in ("README.md", "CHANGELOG.md")]
    files += [os.path.join(ROOT, "docs", n) for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md")]
    files += [os.path.join(BENCH, n) for n in os.listdir(BENCH) if n.endswith(".py")]
    missing = []
    for path in files:
        with open(path) as f:
            for name in set(named.findall(f.read())):
                if not os.path.isdir(os.path.join(RESULTS, name)):
                    missing.append(f"{os.path.relpath(path, ROOT)}: {name}")
    assert not missing, "\n".join(missing)
