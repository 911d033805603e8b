"""Class names the docs quote in backticks (``DecodeCudaGraphRunner``) are classes that exist:
defined in this repository's sources, in a code block of the docs, or another project's
(the line names the project: sglang, vLLM, torch, transformers, Python)."""

from __future__ import annotations

import builtins
import re
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OTHER_PROJECTS = re.compile(r"sglang|vllm|torch|transformers|flashinfer|triton|python|huggingface|\bhf\b", re.I)
#: Other projects' classes quoted on lines that do not name the project, and whose they are.
OTHERS = {
    "AttentionCGSupport": "vLLM's attention-backend declaration",
    "CudaGraphRunner": "sglang's decode graph runner",
    "EagerRunner": "sglang's eager runner",
    "DeprecatedStoreConstAction": "sglang's argparse action",
}
#: A CamelCase name opening a backticked span: ``Name``, ``Name(...)``, ``Name.attr``.
QUOTED = re.compile(r"`([A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+)[`.(\[]")


def _sources():
    for top in ("core", "plugins", "examples", "tests", "benchmarks"):
        for path in (ROOT / top).rglob("*.py"):
            if ".venv" not in path.parts:
                yield path


def _docs():
    yield from sorted((ROOT / "docs").glob("*.md"))
    yield ROOT / "README.md"
    yield from sorted((ROOT / "plugins").glob("*/README.md"))


def test_quoted_class_names_exist():
    defined = set(dir(builtins)) | set(dir(typing)) | set(OTHERS)
    for path in _sources():
        for klass, name in re.findall(r"^\s*(?:class|def)\s+(\w+)|^(\w+)\s*[:=]", path.read_text(), re.M):
            defined.add(klass or name)
    docs = list(_docs())
    for path in docs:  # classes a doc's code block defines
        defined |= set(re.findall(r"^\s*class\s+(\w+)", path.read_text(), re.M))
    missing = []
    for path in docs:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for name in QUOTED.findall(line):
                if name not in defined and not OTHER_PROJECTS.search(line):
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {name}")
    assert missing == [], "\n".join(missing)
