"""Backend ``npu`` on the CPU, against a recording double of torch_npu's graph API.

Checks the capture protocol (warm-ups, ``post_warmup_hook``, one pool, largest first,
``auto_dispatch_capture``), the update-then-replay path (order, same thread, padded host
seq lens, failures never replay) and the contract the runners rely on.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from cuda_graph_runner.backend import BackendUnavailableError, ForwardMode, ShapeKey
from cuda_graph_runner.backend.pool import reset_global_graph_memory_pools
from cuda_graph_runner.testing.fakes import FakeGraphDeviceModule
from cuda_graph_runner.testing.toy_model import ToyModel, decode_batch
from cuda_graph_runner.testing.workload import CudaGraphConfig, DecodeCudaGraphRunner, check_backend_class
from cuda_graph_runner_npu import torch_npu_api
from cuda_graph_runner_npu.backend import NPUCudaGraphBackend, NPUGraphUpdateError
from cuda_graph_runner_npu.testing import CudaBackedNPUModule, RecordingNPUModule

KEY = "actual_seq_lengths_kv"


@pytest.fixture(autouse=True)
def _fresh_pools():
    # The process-wide pool is cached per device string; each test has its own fake.
    reset_global_graph_memory_pools()
    yield
    reset_global_graph_memory_pools()


def make(fake=None, **kwargs):
    fake = fake or RecordingNPUModule()
    return fake, NPUCudaGraphBackend("cpu", phase="decode", device_module=fake, **kwargs)


def make_runner(backend, max_bs=8, **kwargs):
    cfg = CudaGraphConfig.from_dict({"decode": {"max_bs": max_bs}})
    return DecodeCudaGraphRunner(ToyModel(), cfg, device="cpu", backend=backend, show_progress=False, **kwargs)


def capture_begins(fake):
    return [e for e in fake.events if e[0] == "capture_begin"]


# ------------------------------------------------------------------------------- capture


def test_capture_one_warms_up_runs_the_hook_then_records_on_the_stream():
    fake, backend = make()
    stream = fake.Stream()
    key = ShapeKey(4, "decode")

    def forward():
        fake.events.append(("forward", fake.capturing is not None))
        return torch.zeros(4, 2)

    with backend.capture_session(stream):
        backend.capture_one(key, forward, post_warmup_hook=lambda: fake.events.append(("hook",)))
    names = fake.names("synchronize", "stream", "forward", "hook", "capture_begin", "capture_end", "graph_pool_handle")
    assert names == [
        "synchronize",
        "stream",
        "forward",  # warm-up 1 on the capture stream
        "stream",
        "forward",  # warm-up 2, same stream: no sync between
        "hook",  # post_warmup_hook after the warm-ups ...
        "synchronize",
        "graph_pool_handle",  # ... and before the capture
        "capture_begin",
        "forward",
        "capture_end",
    ]
    forwards = [e for e in fake.events if e[0] == "forward"]
    assert [f[1] for f in forwards] == [False, False, True]  # only the third run is recorded
    (begin,) = capture_begins(fake)
    # graph(g, pool=<one pool>, stream=<capture stream>, auto_dispatch_capture=True)
    assert begin[2] == fake.pool_handle and begin[3] is stream and begin[4] is True and begin[5] == "global"
    assert backend.captured_keys == [key]


def test_capture_one_without_hook_and_without_stream():
    fake, backend = make()
    with backend.capture_session(None):
        backend.capture_one(ShapeKey(1, "decode"), lambda: torch.zeros(1))
    assert "stream" not in fake.names()
    assert capture_begins(fake)[0][3] is None


def test_runner_captures_largest_first_into_one_pool_and_calls_the_models_hook():
    fake, backend = make()
    runner = make_runner(backend, max_bs=8)
    runner.capture()
    assert backend.captured_keys == [ShapeKey(s, "decode") for s in (8, 4, 2, 1)]
    begins = capture_begins(fake)
    assert len(begins) == 4 and {b[2] for b in begins} == {fake.pool_handle}
    assert fake.names().count("graph_pool_handle") == 1  # one pool for every size
    assert all(b[4] is True for b in begins)
    # The runner passes the model's post_warmup_hook, and the backend calls it.
    assert runner.model.post_warmup_calls == 4


def test_an_explicit_pool_is_used_as_given():
    fake, backend = make(memory_pool="shared-pool")
    runner = make_runner(backend, max_bs=2)
    runner.capture()
    assert {b[2] for b in capture_begins(fake)} == {"shared-pool"}
    assert "graph_pool_handle" not in fake.names()


def test_capture_error_mode_is_passed_through():
    fake, backend = make(capture_error_mode="thread_local")
    make_runner(backend, max_bs=1).capture()
    assert capture_begins(fake)[0][5] == "thread_local"


def test_capturing_a_shape_twice_is_refused_and_cleanup_allows_recapture():
    fake, backend = make()
    runner = make_runner(backend, max_bs=2)
    runner.capture()
    with pytest.raises(ValueError, match="already captured"):
        backend.capture_one(ShapeKey(2, "decode"), lambda: None)
    runner.cleanup()
    assert fake.names().count("reset") == 2 and backend.captured_keys == []
    runner.capture()
    assert runner.can_run(decode_batch(2))


# ------------------------------------------------------------------- update then replay


def replay_events(fake):
    return [e for e in fake.events if e[0] in ("update_begin", "update_end", "replay", "synchronize")]


@pytest.mark.parametrize("bs", [1, 3, 5, 8])
def test_replay_updates_the_padded_host_seq_lens_then_replays(bs):
    fake, backend = make()
    runner = make_runner(backend, max_bs=8)
    runner.capture()
    fake.events.clear()
    batch = decode_batch(bs)
    assert runner.can_run(batch)
    out = runner.forward(batch)
    padded = runner.padded_size(bs)
    graph_id = fake.graphs[backend.captured_keys.index(ShapeKey(padded, "decode"))].id
    events = replay_events(fake)
    assert [e[0] for e in events] == ["update_begin", "update_end", "replay"]
    assert all(e[1] == graph_id for e in events)
    expected = batch.seq_lens_cpu + [runner.seq_len_fill_value] * (padded - bs)
    assert events[0][2] == [{KEY: expected}]
    assert all(isinstance(v, int) for v in events[0][2][0][KEY])
    assert out.shape == (bs, 16)


def test_update_finishes_before_the_replay_even_when_slow():
    # An update on another thread would finish after the replay started when slow; the
    # replay is issued only after the update returns.
    fake, backend = make()
    runner = make_runner(backend, max_bs=4)
    runner.capture()
    fake.update_delay_s = 0.05
    fake.events.clear()
    runner.forward(decode_batch(3))
    events = replay_events(fake)
    assert [e[0] for e in events] == ["update_begin", "update_end", "replay"]
    me = threading.get_ident()
    assert events[0][3] == me and events[1][2] == me and events[2][2] == me


def test_a_failed_update_raises_with_its_cause_and_never_replays():
    fake, backend = make()
    runner = make_runner(backend, max_bs=4)
    runner.capture()
    cause = RuntimeError("aclmdlRIUpdate failed: 507899")
    fake.update_error = cause
    fake.events.clear()
    with pytest.raises(NPUGraphUpdateError, match=r"ShapeKey\(size=4.*not replayed") as info:
        runner.forward(decode_batch(3))
    assert info.value.__cause__ is cause
    assert "aclmdlRIUpdate failed" in str(info.value)
    assert "replay" not in fake.names()
    # The next update succeeds and replays normally.
    fake.update_error = None
    runner.forward(decode_batch(3))
    assert fake.names("update_begin", "update_end", "replay")[-3:] == ["update_begin", "update_end", "replay"]


def test_synchronize_before_update_orders_sync_update_replay():
    fake, backend = make(synchronize_before_update=True)
    runner = make_runner(backend, max_bs=2)
    runner.capture()
    fake.events.clear()
    runner.forward(decode_batch(2))
    assert [e[0] for e in replay_events(fake)] == ["synchronize", "update_begin", "update_end", "replay"]


def test_batch_without_host_seq_lens_runs_eagerly_and_direct_replay_refuses():
    fake, backend = make()
    runner = make_runner(backend, max_bs=4)
    runner.capture()
    batch = decode_batch(3).replace(seq_lens_cpu=None)
    fake.events.clear()
    assert not runner.can_run(batch)
    torch.testing.assert_close(runner.forward(batch), runner.eager_forward(batch))
    assert not replay_events(fake)
    key, static = runner.replay_prepare(batch)
    with pytest.raises(NPUGraphUpdateError, match="seq_lens_cpu is None"):
        backend.replay(key, static)
    assert "replay" not in fake.names()


def test_replay_of_an_unknown_key_is_a_key_error():
    _, backend = make()
    with pytest.raises(KeyError, match="no graph captured"):
        backend.replay(ShapeKey(2, "decode"), decode_batch(2))


def test_update_input_name_selects_the_argument_name():
    fake, backend = make(update_input_name="actual_seq_kvlen")
    runner = make_runner(backend, max_bs=2)
    runner.capture()
    runner.forward(decode_batch(2))
    (update,) = [e for e in fake.events if e[0] == "update_begin"]
    assert list(update[2][0]) == ["actual_seq_kvlen"]


def test_cpu_update_input_fn_builds_the_whole_update():
    seen = []

    def build(static_batch):
        seen.append(static_batch.batch_size)
        return [
            {"actual_seq_lengths_kv": torch.tensor(static_batch.seq_lens_cpu, dtype=torch.int32)},
            {"actual_seq_lengths": [1] * static_batch.batch_size},
        ]

    fake, backend = make(update_input_name=None, cpu_update_input_fn=build)
    assert backend.updates_host_inputs
    runner = make_runner(backend, max_bs=4)
    runner.capture()
    assert all(b[4] is True for b in capture_begins(fake))
    runner.forward(decode_batch(3))
    (update,) = [e for e in fake.events if e[0] == "update_begin"]
    assert seen == [4] and len(update[2]) == 2 and update[2][0][KEY].dtype == torch.int32


def test_updates_off_captures_plainly_and_replays_without_update():
    fake, backend = make(update_input_name=None)
    assert not backend.updates_host_inputs
    runner = make_runner(backend, max_bs=2)
    runner.capture()
    assert all(b[4] is False for b in capture_begins(fake))
    batch = decode_batch(2).replace(seq_lens_cpu=None)
    assert runner.can_run(batch)  # nothing host-side to update
    fake.events.clear()
    runner.forward(batch)
    assert fake.names("update_begin", "replay") == ["replay"]
    # As in torch_npu, a graph captured without auto_dispatch_capture cannot be updated.
    with pytest.raises(RuntimeError, match="auto_dispatch_capture=True"):
        fake.graphs[0].update(cpu_update_input=[{KEY: [1, 1]}])


def test_target_verify_updates_one_length_per_request():
    fake, backend = make()
    runner = make_runner(backend, max_bs=4, mode=ForwardMode.TARGET_VERIFY, num_tokens_per_req=3)
    runner.capture()
    assert backend.captured_keys[0] == ShapeKey(4, "target_verify:3")
    batch = decode_batch(3, width=3)
    out = runner.forward(batch)
    (update,) = [e for e in fake.events if e[0] == "update_begin"]
    assert update[2] == [{KEY: batch.seq_lens_cpu + [3]}]
    assert out.shape == (9, 16)


# ------------------------------------------------------------------------------ contract


def test_backend_class_honours_the_runner_contract():
    check_backend_class(NPUCudaGraphBackend, "npu")


def test_fakes_expose_every_name_and_keyword_the_backend_calls():
    assert torch_npu_api.graph_api_problems(RecordingNPUModule(), capture_error_mode=True) == []
    assert torch_npu_api.graph_api_problems(CudaBackedNPUModule(), capture_error_mode=True) == []


def test_a_device_module_without_npu_graphs_is_refused_with_what_is_missing():
    _, backend = make(fake=torch.cuda)
    with pytest.raises(BackendUnavailableError, match="lacks the graph API.*no NPUGraph"):
        backend.capture_one(ShapeKey(1, "decode"), lambda: None)


def test_core_fake_graph_module_works_when_updates_are_off():
    fake = FakeGraphDeviceModule()
    backend = NPUCudaGraphBackend("cpu", device_module=fake, update_input_name=None, memory_pool="p")
    runner = make_runner(backend, max_bs=2)
    runner.capture()
    runner.forward(decode_batch(1))
    assert fake.names()[-1] == "replay"


def test_npu_device_without_torch_npu_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # hide any real torch_npu
    torch_npu_api.reset_cache()
    try:
        with pytest.raises(BackendUnavailableError, match="torch_npu is not installed"):
            NPUCudaGraphBackend("npu:0")
    finally:
        torch_npu_api.reset_cache()
