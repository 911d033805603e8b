"""docs/porting-from-sglang.md: every Python block runs as written, in order, in one
namespace (each block's own asserts check what it shows: replays, the hooks' arguments,
the subclass's sizes, the platform backend), on the CPU with emulated graphs."""

from __future__ import annotations

import pathlib
import re

GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "porting-from-sglang.md"


def test_every_python_block_of_the_guide_runs():
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert len(blocks) == 4, "the guide's four blocks: model runner, attention hooks, runner subclass, platform backend"
    namespace: dict = {"__name__": "porting_guide"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{GUIDE.name} block {i + 1}", "exec"), namespace)
    assert namespace["platform_runner"].backend.name == "myplatform_full"
