"""GPU: profiler traces of real replays and captures (:mod:`cuda_graph_runner.backend.profiling`).

* A torch profiler trace (CPU + CUDA activities) of decode replays with ``full`` and
  ``breakable`` and of a breakable prefill replay, exported as chrome-trace JSON and
  parsed back: every replay is a range named by phase, backend and key, in call order,
  and the graph launches (``cudaGraphLaunch``) run inside it: one for ``full``, one per
  segment for a breakable prefill shape.
* Capture traces: one file per size, holding the capture range and the warm-ups' kernels.
* Kernel annotations: on a torch and driver that offer them the captured kernels carry
  layer names; elsewhere (torch 2.11) the switch changes nothing and replays equal eager.

The traces are written under ``$OUT/profiler-traces`` when ``OUT`` is set (commit them with
the results: ``tests/test_profiler_trace_format.py`` parses the committed ones), else into a
temporary folder.

Run on the device machine: ``python -m pytest tests/test_profiling_gpu.py -s``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from cuda_graph_runner.backend import profiling
from cuda_graph_runner.reference.batches import eager_logits_fn, make_dummy_prompts, make_extend_batch
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner
from cuda_graph_runner.testing.reference_setup import free_requests, prefilled_decode_batch, reference_model

pytestmark = pytest.mark.gpu

ACTIVITIES = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]


@pytest.fixture
def model():
    # Per test (tiny builds in well under a second): a failed test's open requests must not
    # fill the next test's KV cache.
    return reference_model("tiny", requests=24)


@pytest.fixture
def out_dir(tmp_path):
    out = os.environ.get("OUT")
    folder = os.path.join(out, "profiler-traces") if out else str(tmp_path)
    os.makedirs(folder, exist_ok=True)
    return folder


def _decode(model, bs: int, seed: int):
    prompts = make_dummy_prompts(bs, [3 + (i + seed) % 5 for i in range(bs)], model.config.vocab_size, seed=seed)
    return prefilled_decode_batch(model, prompts)


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_decode_replays_are_named_ranges_around_their_graph_launches(model, backend, out_dir):
    runner = DecodeCudaGraphRunner(model, {"decode": {"backend": backend, "bs": [4, 8]}}, show_progress=False)
    runner.capture()
    s3, b3 = _decode(model, 3, seed=1)
    s8, b8 = _decode(model, 8, seed=2)
    runner.forward(b3)  # first replay outside the trace
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=ACTIVITIES) as prof:
        runner.forward(b3)
        runner.forward(b8)
        torch.cuda.synchronize()
    path = os.path.join(out_dir, f"replay-decode-{backend}.trace.json")
    prof.export_chrome_trace(path)
    found = profiling.graph_launches_per_replay(path)
    assert [name for name, _ in found] == [
        f"cuda_graph_runner.replay decode/{backend}/bs=4 decode",
        f"cuda_graph_runner.replay decode/{backend}/bs=8 decode",
    ]

    def launches(size: int) -> int:  # one graph, or one per breakable segment
        return 1 if backend == "full" else len(runner.backend.graph(runner.plain_key(size)).segments)

    assert [n for _, n in found] == [launches(4), launches(8)], found
    for s in (s3, s8):
        s.close()
    runner.cleanup()


def test_breakable_prefill_replay_range_holds_one_launch_per_segment(model, out_dir):
    runner = PrefillCudaGraphRunner(model, {"prefill": {"backend": "breakable", "bs": [64]}}, show_progress=False)
    runner.capture()
    batch = make_extend_batch(model.kv_cache, make_dummy_prompts(3, [20, 9, 14], model.config.vocab_size, seed=3))
    eager = eager_logits_fn(model)
    expected = eager(batch)
    runner.forward(batch)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=ACTIVITIES) as prof:
        got = runner.forward(batch)
        torch.cuda.synchronize()
    path = os.path.join(out_dir, "replay-prefill-breakable.trace.json")
    prof.export_chrome_trace(path)
    segments = len(runner.backend.graph(runner.captured_keys[0]).segments)
    assert segments == model.config.num_hidden_layers + 1
    assert profiling.graph_launches_per_replay(path) == [
        ("cuda_graph_runner.replay prefill/breakable/bs=64 extend", segments)
    ]
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
    free_requests(model.kv_cache, batch)
    runner.cleanup()


def test_capture_traces_hold_the_capture_range_and_its_kernels(model, out_dir):
    folder = os.path.join(out_dir, "capture")
    runner = DecodeCudaGraphRunner(
        model, {"decode": {"backend": "full", "bs": [2, 4]}}, show_progress=False, capture_trace_dir=folder
    )
    runner.capture()
    for size in (2, 4):
        path = profiling.capture_trace_path(folder, "decode", "full", 0, size)
        assert [e["name"] for e in profiling.trace_ranges(path)] == [f"cuda_graph_runner.capture decode/full/bs={size}"]
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        assert any(e.get("cat") == "kernel" for e in events), f"no kernel in the capture trace of bs={size}"
    runner.cleanup()


def test_kernel_annotations_name_layers_where_offered(model, out_dir):
    ok, why = profiling.kernel_annotations_available(torch.device("cuda"))
    print(f"torch {torch.__version__}: kernel annotations {'available' if ok else 'unavailable: ' + why}")
    runner = DecodeCudaGraphRunner(
        model, {"decode": {"backend": "full", "bs": [4]}}, show_progress=False, kernel_annotations=True
    )
    runner.capture()
    assert runner.backend.kernel_annotations is ok
    s3, b3 = _decode(model, 3, seed=4)
    torch.testing.assert_close(runner.forward(b3), eager_logits_fn(model)(b3), rtol=1e-3, atol=1e-3)
    count = profiling.save_kernel_annotations(os.path.join(out_dir, "kernel_annotations.pkl"))
    if ok:
        module = profiling.annotations_module()
        names = {a.get("name") for anns in module.get_kernel_annotations().values() for a in anns}
        assert count > 0 and any(str(n).startswith("model.layers.0") for n in names), sorted(map(str, names))[:20]
    else:
        assert count == 0
    s3.close()
    runner.cleanup()
