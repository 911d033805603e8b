"""The README's Python snippet runs as written on this machine (CPU without CUDA here)."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_use_snippet_runs(capsys):
    text = (ROOT / "README.md").read_text()
    snippets = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    use = [s for s in snippets if "DecodeCudaGraphRunner(model" in s]
    assert use, "README lost its DecodeCudaGraphRunner snippet"
    exec(compile(use[0], "README.md", "exec"), {"__name__": "readme"})
    backend, tokens = capsys.readouterr().out.strip().split(" ", 1)
    assert backend and len(ast.literal_eval(tokens)) == 3
