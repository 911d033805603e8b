"""Code, comments, test names and docs state what is: no history (that is CHANGELOG.md's).

Scanned: ``core/``, ``plugins/``, ``tests/``, ``benchmarks/*.py``, ``scripts/``, ``docs/``
and ``README.md`` (text files). Not scanned: CHANGELOG.md, and data (stored results, their
dated folder names, images).

Each pattern below names a kind of history; the exceptions are the legitimate uses of the
same words, kept precise so the check stays a check:

* a reference to an issue or pull request of our own tracker (``issue 23``, ``#23``). A
  reference whose line (or the line before) names the project it belongs to (``pytorch
  issue #186026``, ``sglang's ... (PR #19102)``) cites a source, and so does a ``#N`` the
  same file links to that project's GitHub page;
* words telling how the code was: "as before", "the seed", "previously", "used to",
  "no longer", "now does", "formerly", "anymore", "legacy". "legacy" is also the name of
  sglang's deprecated-flag tier (``legacy:--cuda-graph-bs`` sources, ``legacy flags``) and
  part of torch's "legacy" autograd profiler: lines with those are what is, not history;
* rounds and sessions of work: "round 3", "in an earlier round", "session 2", "a previous
  session". A round of interleaved timing ("per round", "one round") or of speculative
  decoding (draft + verify: "the next round's", "the previous round accepted"), a
  "rounding", and a capture, replay or greedy session are not matched, or are excepted
  where they are the speculative loop's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".ini", ".yaml", ".yml", ""}
SKIP_PARTS = {".venv", "__pycache__", ".git", "build", "dist", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
#: Projects whose issues and pull requests are sources we cite.
SOURCES = re.compile(r"sglang|vllm|pytorch|\btorch\b|transformers|flashinfer|triton|cpython|python/", re.I)

# (what it is, pattern, an exception on the same line or None)
HISTORY: List[Tuple[str, "re.Pattern[str]", "re.Pattern[str] | None"]] = [
    ("an issue of our tracker", re.compile(r"\bissues? #?\d+", re.I), SOURCES),
    ("an issue or pull request number", re.compile(r"(?<![\w&/#])#\d+\b(?![-\w])"), SOURCES),
    ("how it was", re.compile(r"\bas before\b|\bpreviously\b|\bused to\b|\bno longer\b|\bnow does\b", re.I), None),
    ("how it was", re.compile(r"\bformerly\b|\banymore\b|\bthe seed\b|\bthe seed's\b", re.I), None),
    (
        "legacy",
        re.compile(r"\blegacy\b", re.I),
        # sglang's deprecated-flag tier, and torch's legacy autograd profiler
        re.compile(r"legacy[ _-]flags?\b|legacy:|_legacy\b|TIER_LEGACY|torch\.autograd\.profiler", re.I),
    ),
    ("a round of work", re.compile(r"\bround \d+\b|\b(previous|earlier|prior|last) rounds?\b", re.I), None),
    ("a session of work", re.compile(r"\bsessions? \d+\b|\b(previous|earlier|prior|last) sessions?\b", re.I), None),
]
#: Where "legacy" names sglang's deprecated-flag tier (its own word for those flags: the
#: config's flag table and its tests, the sglang compatibility page), in any form.
SGLANG_LEGACY_FLAGS = (
    "core/cuda_graph_runner/config/*.py",
    "tests/test_config_*.py",
    "tests/test_sglang_command_lines.py",
    "docs/sglang-compat.md",
)
#: The speculative loop's rounds (draft + verify) are rounds of the algorithm.
SPECULATIVE_ROUNDS = ("speculative", "draft")


def _files() -> Iterator[Path]:
    roots = [ROOT / "core", ROOT / "plugins", ROOT / "tests", ROOT / "scripts", ROOT / "docs"]
    for top in roots:
        for path in sorted(top.rglob("*")):
            if path.is_file() and path.suffix in TEXT_SUFFIXES and not SKIP_PARTS & set(path.parts):
                if not any(part.endswith(".egg-info") for part in path.parts):
                    yield path
    yield from sorted((ROOT / "benchmarks").glob("*.py"))
    yield from sorted(p for p in (ROOT / ".ci").iterdir() if p.is_file())
    yield ROOT / "README.md"


def _linked_numbers(text: str) -> set:
    """``#N`` numbers the file links to another project's GitHub issue or pull request."""
    return set(re.findall(r"github\.com/[\w.-]+/[\w.-]+/(?:pull|issues)/(\d+)", text))


def _history(path: Path, root: Path = ROOT) -> List[str]:
    try:
        text = path.read_text()
    except UnicodeDecodeError:  # a binary file: no prose
        return []
    linked = _linked_numbers(text)
    speculative = any(word in path.name for word in SPECULATIVE_ROUNDS)
    relative = path.relative_to(root)
    legacy_flags = any(relative.match(pattern) for pattern in SGLANG_LEGACY_FLAGS)
    found = []
    lines = text.splitlines()
    for n, line in enumerate(lines, 1):
        # A reference's project may be named on the line before (a sentence wrapped).
        context = line if n == 1 else lines[n - 2] + " " + line
        for what, pattern, exception in HISTORY:
            for match in pattern.finditer(line):
                if exception is not None and exception.search(context if exception is SOURCES else line):
                    continue
                if what == "an issue or pull request number" and match.group()[1:] in linked:
                    continue
                if what == "legacy" and legacy_flags:
                    continue
                if what == "a round of work" and speculative and not match.group()[-1].isdigit():
                    continue
                found.append(f"{relative}:{n}: {what}: {line.strip()[:160]}")
    return found


def test_no_source_test_or_doc_tells_history():
    files = list(_files())
    assert len(files) > 200, "the scan found too few files to mean anything"
    found = [hit for path in files if path != Path(__file__).resolve() for hit in _history(path)]
    assert found == [], "history belongs in CHANGELOG.md; state what is:\n" + "\n".join(found)


def test_the_check_finds_each_kind_and_spares_the_legitimate_uses(tmp_path):
    told = {
        "fixes issue 23": "an issue of our tracker",
        "see #41 for why": "an issue or pull request number",
        "works as before": "how it was",
        "the seed's backend": "how it was",
        "it no longer copies": "how it was",
        "the legacy path": "legacy",
        "added in round 3": "a round of work",
        "as in the previous session": "a session of work",
    }
    fine = [
        "pytorch issue #186026 asks for it",
        "sglang's breakable CUDA graph (PR #19102)",
        "Idea: sglang's startup reports",
        "(#6830, #3902); a wrapped sentence",
        "legacy flags such as --cuda-graph-bs; source legacy:--disable-cuda-graph",
        "rounding to the next multiple; one round of 20 calls; per round",
        "a capture session; the replay session; GreedySession",
        "[the contract](#3-the-contract)",
    ]
    sample = tmp_path / "sample.py"
    sample.write_text("\n".join([*told, *fine]) + "\n")
    hits = _history(sample, tmp_path)
    kinds = [hit.split(": ")[1] for hit in hits]
    assert kinds == list(told.values()), hits
