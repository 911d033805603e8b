"""GPU: the ``npu`` backend's own capture and update-then-replay code, run on CUDA graphs.

There is no Ascend device here, so the torch_npu graph API is provided by
``CudaBackedNPUModule`` (``NPUGraph``/``graph``/``graph_pool_handle``/``Stream``/``stream``/
``synchronize`` on ``torch.cuda``); its ``update(cpu_update_input=...)`` writes the host
sequence lengths into the runner's static ``seq_lens`` buffer, the device tensor they stand
for. The backend, the runner and the reference model are the real ones.
"""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.testing.reference_setup import reference_model, staggered_decode_case
from cuda_graph_runner.testing.workload import DecodeCudaGraphRunner
from cuda_graph_runner_npu.backend import NPUCudaGraphBackend, NPUGraphUpdateError
from cuda_graph_runner_npu.testing import CudaBackedNPUModule
from cuda_graph_runner_npu.torch_npu_api import DEFAULT_UPDATE_INPUT_NAME

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    return reference_model("tiny", requests=16)


class SeqLensFromUpdateOnly(DecodeCudaGraphRunner):
    """Overwrites the static ``seq_lens`` after filling them, so a replay sees the live
    lengths only if the backend's update wrote them back before the replay."""

    def replay_prepare(self, batch):
        key, static = super().replay_prepare(batch)
        static.seq_lens.fill_(self.seq_len_fill_value)
        return key, static


def make_runner(model, *, max_bs=8, runner_cls=DecodeCudaGraphRunner, **backend_kwargs):
    adapter = CudaBackedNPUModule()
    backend = NPUCudaGraphBackend("cuda", phase="decode", device_module=adapter, **backend_kwargs)
    runner = runner_cls(model, {"decode": {"max_bs": max_bs}}, device="cuda", backend=backend, show_progress=False)
    adapter.bind(DEFAULT_UPDATE_INPUT_NAME, runner.buffers["seq_lens"])
    with torch.no_grad():
        runner.capture()
    return runner, adapter


def test_npu_backend_on_cuda_graphs_matches_eager(model):
    runner, adapter = make_runner(model, max_bs=8)
    assert runner.capture_sizes == [1, 2, 4, 8]
    assert [k.size for k in runner.backend.captured_keys] == [8, 4, 2, 1]  # largest first
    assert all(g.auto_dispatch_capture for g in adapter.graphs)
    pools = {g.pool() for g in adapter.graphs}
    assert len(pools) == 1  # one shared pool
    for bs in (1, 2, 3, 5, 8):
        session, batch, expected = staggered_decode_case(model, bs, seed=bs)
        before = [(g.updates, g.replays) for g in adapter.graphs]
        with torch.no_grad():
            assert runner.can_run(batch)
            got = runner.forward(batch)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=f"batch size {bs}")
        after = [(g.updates, g.replays) for g in adapter.graphs]
        changed = [i for i, (b, a) in enumerate(zip(before, after)) if b != a]
        assert len(changed) == 1 and after[changed[0]] == (before[changed[0]][0] + 1, before[changed[0]][1] + 1)
        session.close()
    runner.cleanup()


def test_host_seq_lens_reach_the_graph_through_the_update_before_the_replay(model):
    runner, _ = make_runner(model, max_bs=8, runner_cls=SeqLensFromUpdateOnly)
    control, _ = make_runner(model, max_bs=8, runner_cls=SeqLensFromUpdateOnly, update_input_name=None)
    for bs in (3, 8):
        session, batch, expected = staggered_decode_case(model, bs, seed=10 + bs)
        with torch.no_grad():
            got = runner.forward(batch).clone()
            stale = control.forward(batch).clone()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=f"batch size {bs}")
        # Without the update the graph reads the overwritten lengths: the check has teeth.
        assert not torch.allclose(stale, expected, rtol=1e-3, atol=1e-3)
        session.close()
    runner.cleanup()
    control.cleanup()


def test_a_failed_update_never_replays_on_the_device(model):
    runner, adapter = make_runner(model, max_bs=4)
    session, batch, expected = staggered_decode_case(model, 3, seed=99)
    adapter.update_error = RuntimeError("update stream fault")
    with torch.no_grad(), pytest.raises(NPUGraphUpdateError, match="not replayed") as info:
        runner.forward(batch)
    assert str(info.value.__cause__) == "update stream fault"
    assert sum(g.replays for g in adapter.graphs) == 0
    adapter.update_error = None
    with torch.no_grad():
        torch.testing.assert_close(runner.forward(batch), expected, rtol=1e-4, atol=1e-4)
    session.close()
    runner.cleanup()
