"""Profiler support (:mod:`cuda_graph_runner.backend.profiling`): the named range of every replay in
a CPU profiler trace, nothing entered with no profiler, per-size capture traces written
where asked, kernel annotations off where torch or the device lacks them and layer-named
where a (stand-in) annotation module records."""

from __future__ import annotations

import contextlib
import json
import os
import types

import pytest
import torch
from toy_model import ToyModel, decode_batch

from cuda_graph_runner.backend import profiling
from cuda_graph_runner.runner import DecodeCudaGraphRunner
from cuda_graph_runner.testing.fakes import RecordingBackend


class LayeredToy(ToyModel):
    """The toy model with one submodule layer (kernel annotations name layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Sequential(torch.nn.Linear(8, 8))

    def forward(self, batch):
        return self.proj(super().forward(batch))


def _runner(model=None, **kwargs) -> DecodeCudaGraphRunner:
    return DecodeCudaGraphRunner(
        model if model is not None else ToyModel(),
        {"decode": {"bs": [2, 4, 8], "max_bs": 8}},
        device="cpu",
        backend=RecordingBackend("cpu"),
        show_progress=False,
        **kwargs,
    )


def test_replay_range_appears_in_an_exported_cpu_trace(tmp_path):
    runner = _runner()
    runner.capture()
    batch3, batch8 = decode_batch(3), decode_batch(8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        runner.forward(batch3)
        runner.forward(batch8)
        runner.forward(batch3)
    path = str(tmp_path / "replay.trace.json")
    prof.export_chrome_trace(path)
    names = [e["name"] for e in profiling.trace_ranges(path, "cuda_graph_runner.replay")]
    assert names.count("cuda_graph_runner.replay decode/recording/bs=4 decode") == 2
    assert names.count("cuda_graph_runner.replay decode/recording/bs=8 decode") == 1
    # Each range spans time (a complete event with a duration).
    assert all(e["dur"] >= 0 for e in profiling.trace_ranges(path))


def test_an_eager_fallback_step_is_a_range_with_its_reason(tmp_path):
    from cuda_graph_runner.runner.stats import REASON_TOO_LARGE

    runner = _runner()
    runner.capture()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        runner.forward(decode_batch(12))  # above the largest captured size: eager
    path = str(tmp_path / "eager.trace.json")
    prof.export_chrome_trace(path)
    assert [e["name"] for e in profiling.trace_ranges(path)] == [f"cuda_graph_runner.eager decode/{REASON_TOO_LARGE}"]


def test_no_range_is_entered_without_a_profiler(monkeypatch):
    runner = _runner()
    runner.capture()

    def refuse(name):
        raise AssertionError(f"record_function({name!r}) entered with no profiler")

    monkeypatch.setattr(torch.profiler, "record_function", refuse)
    out = runner.forward(decode_batch(3))
    assert out.shape[0] == 3
    assert runner.forward(decode_batch(12)).shape[0] == 12  # the eager fallback enters none either


def test_capture_traces_one_file_per_size(tmp_path):
    folder = tmp_path / "traces" / "decode"  # made by the runner
    runner = _runner(capture_trace_dir=str(folder))
    runner.capture()
    files = sorted(os.listdir(folder))
    assert files == [f"capture-decode-recording-rank0-bs{s}.trace.json" for s in (2, 4, 8)]
    for size in (2, 4, 8):
        path = profiling.capture_trace_path(str(folder), "decode", "recording", 0, size)
        ranges = [e["name"] for e in profiling.trace_ranges(path)]
        assert ranges == [f"cuda_graph_runner.capture decode/recording/bs={size}"]
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        # The capture's forward ran inside the trace (the toy model's logits matmul).
        assert any(e.get("name") == "aten::mm" for e in events)


def test_capture_traces_are_named_by_the_process_rank_without_a_tp_group(tmp_path, monkeypatch):
    monkeypatch.setattr(profiling, "process_rank", lambda: 3)
    _runner(capture_trace_dir=str(tmp_path)).capture(sizes=[4])
    assert os.listdir(tmp_path) == ["capture-decode-recording-rank3-bs4.trace.json"]


def test_capture_trace_skipped_under_an_outer_profiler(tmp_path):
    runner = _runner(capture_trace_dir=str(tmp_path))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        runner.capture(sizes=[2])
    assert os.listdir(tmp_path) == []
    assert runner.captured_keys


@pytest.mark.parametrize("bad", [123, ""])
def test_capture_trace_dir_of_a_wrong_type_is_refused(bad):
    with pytest.raises(profiling.CaptureTraceError, match="capture_trace_dir"):
        _runner(capture_trace_dir=bad)


def test_capture_trace_dir_naming_a_file_is_refused(tmp_path):
    file = tmp_path / "a-file"
    file.write_text("keep me")
    with pytest.raises(profiling.CaptureTraceError, match="is a file"):
        _runner(capture_trace_dir=str(file))
    assert file.read_text() == "keep me"


def test_kernel_annotations_are_off_on_the_cpu_and_capture_still_works(caplog):
    ok, why = profiling.kernel_annotations_available(torch.device("cpu"))
    assert not ok and "cpu" in why
    runner = _runner(kernel_annotations=True)
    with caplog.at_level("INFO", logger="cuda_graph_runner.runner.base"):
        runner.capture()
    assert runner.backend.kernel_annotations is False
    assert sum("kernel annotations off" in r.getMessage() for r in caplog.records) == 1
    assert runner.forward(decode_batch(3)).shape[0] == 3


def test_kernel_annotations_flag_must_be_a_bool():
    with pytest.raises(TypeError, match="kernel_annotations"):
        _runner(kernel_annotations="yes")


def test_annotation_module_matches_the_torch_version():
    module = profiling.annotations_module()
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    if (major, minor) >= (2, 12):
        assert module is not None and callable(module.mark_kernels)
    else:
        assert module is None


def test_layers_are_named_where_an_annotation_module_records(monkeypatch):
    seen = []

    @contextlib.contextmanager
    def mark_kernels(annotation):
        seen.append(annotation["name"])
        yield

    fake = types.SimpleNamespace(mark_kernels=mark_kernels)
    monkeypatch.setattr(profiling, "annotations_module", lambda: fake)
    monkeypatch.setattr(profiling, "kernel_annotations_available", lambda device: (True, ""))
    runner = _runner(LayeredToy(), kernel_annotations=True)
    runner.backend.annotates_layers = lambda: True  # as full's does
    runner.capture(sizes=[2])
    assert runner.backend.kernel_annotations is True
    # Every warm-up and the capture run, each layer by its qualified name, outer first.
    assert seen[:2] == ["proj", "proj.0"]
    assert len(seen) % 2 == 0 and len(seen) >= 4 and set(seen) == {"proj", "proj.0"}
    # The hooks are gone after capture: an eager forward annotates nothing.
    seen.clear()
    runner.run_eager(decode_batch(3))
    assert seen == []


def test_layer_annotations_wait_for_a_backend_that_records_one_graph_per_shape(monkeypatch, caplog):
    monkeypatch.setattr(profiling, "kernel_annotations_available", lambda device: (True, ""))
    runner = _runner(LayeredToy(), kernel_annotations=True)  # RecordingBackend: the base's False
    with caplog.at_level("INFO", logger="cuda_graph_runner.runner.base"):
        runner.capture(sizes=[2])
    assert runner.backend.kernel_annotations is False
    assert any("does not record one eager graph per shape" in r.getMessage() for r in caplog.records)


def test_base_backend_asks_the_device_graph_for_annotations():
    from cuda_graph_runner.testing.fakes import FakeGraphDeviceModule

    module = FakeGraphDeviceModule()
    options = []
    graph = module.graph

    def recording_graph(cuda_graph, pool=None, stream=None, **kwargs):
        options.append(kwargs)
        return graph(cuda_graph, pool=pool, stream=stream)

    module.graph = recording_graph
    backend = RecordingBackend("cpu", device_module=module)
    with backend.graph_capture(module.CUDAGraph()):
        pass
    backend.kernel_annotations = True
    with backend.graph_capture(module.CUDAGraph()):
        pass
    assert options == [{}, {"enable_annotations": True}]


def test_trace_ranges_refuses_a_file_that_is_not_a_trace(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"nothing": 1}')
    with pytest.raises(ValueError, match="not a chrome trace"):
        profiling.trace_ranges(str(path))


def test_graph_launches_are_counted_inside_each_range_on_its_thread(tmp_path):
    def event(name, ts, dur, tid=1, cat="cuda_runtime"):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "cat": cat}

    events = [
        event("cuda_graph_runner.replay decode/full/bs=8 decode", 100, 50, cat="user_annotation"),
        event("cudaGraphLaunch", 110, 5),
        event("cudaGraphLaunch", 120, 5, tid=2),  # another thread: not this replay's
        event("cuda_graph_runner.replay decode/full/bs=4 decode", 10, 20, cat="user_annotation"),
        event("cudaGraphLaunch", 15, 5),
        event("cudaGraphLaunch", 25, 5),
        event("cudaGraphLaunch", 60, 5),  # between the ranges
        {"ph": "i", "name": "cuda_graph_runner.replay decode/full/bs=2 decode", "ts": 70},  # not a complete event
        # A trace with CUDA activity repeats each range on the GPU timeline (as on the H200):
        event("cuda_graph_runner.replay decode/full/bs=8 decode", 101, 49, tid=7, cat="gpu_user_annotation"),
        event("cuda_graph_runner::reference_llama_attention", 112, 2, cat="user_annotation"),  # a marked op's own
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert profiling.graph_launches_per_replay(str(path)) == [
        ("cuda_graph_runner.replay decode/full/bs=4 decode", 2),
        ("cuda_graph_runner.replay decode/full/bs=8 decode", 1),
    ]
    assert [e["name"] for e in profiling.trace_ranges(str(path))] == [
        "cuda_graph_runner.replay decode/full/bs=8 decode",
        "cuda_graph_runner.replay decode/full/bs=4 decode",
    ]


def test_layer_scopes_run_with_torchs_own_annotation_module(monkeypatch):
    """The real mark_kernels (a no-op without a capturing CUDA stream) takes what the layer
    hooks pass, and torch.cuda.graph takes the keyword graph_capture passes."""
    import inspect

    module = profiling.annotations_module()
    if module is None:
        pytest.skip(f"torch {torch.__version__} has no CUDA-graph kernel annotations")
    assert "enable_annotations" in inspect.signature(torch.cuda.graph).parameters
    monkeypatch.setattr(profiling, "kernel_annotations_available", lambda device: (True, ""))
    runner = _runner(LayeredToy(), kernel_annotations=True)
    runner.backend.annotates_layers = lambda: True
    runner.capture(sizes=[2])
    batch = decode_batch(2)
    torch.testing.assert_close(runner.forward(batch), runner.run_eager(batch))
