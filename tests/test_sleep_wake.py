"""runner.sleep() / wake() on emulated graphs with an emulated pool: graphs and pool given
back, forward while asleep eager (counted) or raising, wake recaptures every size and
variant, a failure midway leaves the runner asleep."""

from __future__ import annotations

import pytest
import torch
from toy_model import ToyModel, decode_batch

from cuda_graph_runner.config import CudaGraphConfig, CudaGraphConfigError
from cuda_graph_runner.runner import DecodeCudaGraphRunner
from cuda_graph_runner.runner.sleep import RunnerAsleepError
from cuda_graph_runner.runner.stats import REASON_ASLEEP
from cuda_graph_runner.testing.fakes import RecordingBackend


class PoolBackend(RecordingBackend):
    """Emulated graphs whose pool is device memory that can be counted: every output
    tensor lives in the backend's shared pool, ``graph_memory_bytes`` is its size."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, share_pool=True, **kwargs)
        self.fail_capture_at = None

    def graph_memory_bytes(self):
        return sum(t.numel() * t.element_size() for t in self._pool.values())

    def capture_one(self, key, forward_fn, **kwargs):
        if self.fail_capture_at is not None and key.size == self.fail_capture_at:
            raise RuntimeError(f"capture of {key} failed")
        super().capture_one(key, forward_fn, **kwargs)


def make_runner(**decode):
    cfg = CudaGraphConfig.from_dict({"decode": {"bs": [1, 2, 4], **decode}})
    return DecodeCudaGraphRunner(
        ToyModel(), cfg, device="cpu", backend=PoolBackend("cpu", phase="decode"), show_progress=False
    )


def test_sleep_gives_the_pool_back_and_wake_recaptures_every_size():
    runner = make_runner()
    runner.capture()
    pool = runner.graph_memory_bytes()
    assert pool > 0
    expected = runner.forward(decode_batch(3)).clone()
    assert runner.sleep() == pool and runner.asleep
    assert runner.graph_memory_bytes() == 0 and runner.captured_keys == []
    assert runner.sleep() == 0  # already asleep: a no-op
    out = runner.forward(decode_batch(3))  # eager while asleep
    torch.testing.assert_close(out, expected)
    assert runner.run_stats()["eager_fallbacks"] == {REASON_ASLEEP: 1}
    report = runner.wake()
    assert not runner.asleep and report.sizes == [4, 2, 1]
    assert runner.graph_memory_bytes() == pool
    torch.testing.assert_close(runner.forward(decode_batch(3)), expected)
    assert runner.run_stats()["replays"] == 2
    assert runner.wake().sizes == []  # awake: a no-op


def test_forward_asleep_raise():
    runner = make_runner(forward_asleep="raise")
    runner.capture()
    runner.sleep()
    assert not runner.can_run(decode_batch(2))
    with pytest.raises(RunnerAsleepError, match=r"wake\(\)"):
        runner.forward(decode_batch(2))
    runner.wake()
    runner.forward(decode_batch(2))


def test_cycles_with_weights_updated_in_place_follow_them_and_stay_flat():
    runner = make_runner(check_weights_every=1)
    runner.capture()
    pool = runner.graph_memory_bytes()
    for _ in range(3):
        runner.sleep()
        with torch.no_grad():
            runner.model.head.add_(0.5)  # in place, while asleep
        runner.wake()
        assert runner.graph_memory_bytes() == pool
        torch.testing.assert_close(runner.forward(decode_batch(2)), runner.run_eager(decode_batch(2)))
    assert runner.check_weights() == 2


def test_weights_reassigned_while_asleep_are_read_by_the_new_graphs():
    runner = make_runner()
    runner.capture()
    runner.sleep()
    runner.model.head = torch.nn.Parameter(runner.model.head.detach() * 2)
    runner.wake()
    assert runner.check_weights() == 2  # the fingerprint is the new one
    torch.testing.assert_close(runner.forward(decode_batch(2)), runner.run_eager(decode_batch(2)))


def test_a_failed_wake_leaves_the_runner_asleep_and_a_retry_works():
    runner = make_runner()
    runner.capture()
    runner.sleep()
    runner.backend.fail_capture_at = 1  # the last size: the larger two were captured first
    with pytest.raises(RuntimeError, match="failed"):
        runner.wake()
    assert runner.asleep and runner.captured_keys == [] and runner.graph_memory_bytes() == 0
    runner.backend.fail_capture_at = None
    assert runner.wake().sizes == [4, 2, 1]


def test_a_failed_sleep_leaves_the_runner_asleep():
    runner = make_runner()
    runner.capture()

    def broken_cleanup():
        raise RuntimeError("cleanup failed")

    runner.backend.cleanup = broken_cleanup
    with pytest.raises(RuntimeError, match="cleanup failed"):
        runner.sleep()
    assert runner.asleep and runner.captured_keys == []
    del runner.backend.cleanup
    assert runner.wake().sizes == [4, 2, 1]


def test_forward_asleep_raise_in_a_data_parallel_step_stops_at_its_agreement():
    from cuda_graph_runner.runner.data_parallel import dp_forward
    from cuda_graph_runner.runner.dp_group import DataParallelStepError

    failures = []

    class OwnValuesDP:  # the step agreement in one process, recording a failed decision
        def agree_batch(self, size, ready, variant, *, variants=("",), failed=None):
            if failed is not None:
                failures.append(failed)
                raise DataParallelStepError(failed)
            return size, ready, variant

    runner = make_runner(forward_asleep="raise")
    runner.capture()
    runner.sleep()
    with pytest.raises(RunnerAsleepError):
        dp_forward(runner, OwnValuesDP(), None)  # an idle rank too: it would run the dummy batch
    assert len(failures) == 1 and failures[0].startswith("RunnerAsleepError")


def test_forward_asleep_bad_value():
    with pytest.raises(CudaGraphConfigError, match="forward_asleep"):
        CudaGraphConfig.from_dict({"decode": {"forward_asleep": "wait"}})


def test_a_pool_still_held_after_sleep_is_reported(caplog):
    runner = make_runner()
    runner.capture()
    other = runner.backend._pool[(99, torch.float32)] = torch.zeros(4)  # another runner's graph

    def cleanup_keeping_the_other():
        RecordingBackend.cleanup(runner.backend)
        runner.backend._pool[(99, torch.float32)] = other

    runner.backend.cleanup = cleanup_keeping_the_other
    with caplog.at_level("WARNING", logger="cuda_graph_runner.runner.sleep"):
        runner.sleep()
    assert "16 bytes stay in its graph pool" in caplog.text and "sleep every runner" in caplog.text
