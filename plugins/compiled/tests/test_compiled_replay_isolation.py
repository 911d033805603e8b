"""Backend ``compiled``: what a replay does is seen by that replay alone. Two runners of one
model replaying from two threads (overlapping, ending out of order) leave another
thread's compiled code, the model's forward and later ``torch.compile`` calls as they
were; a marked op whose body runs compiled code of its own gets that code's guards
evaluated (it recompiles for a new live value) during a replay.

The toy model and the ``eager`` compiler keep each compile to a fraction of a second.
"""

from __future__ import annotations

import threading
from typing import Callable, List, Optional

import torch

from cuda_graph_runner.backend import forward_context, get_forward_batch, register_eager_op
from cuda_graph_runner.testing.toy_model import ToyModel, decode_batch
from cuda_graph_runner.testing.workload import DecodeCudaGraphRunner
from cuda_graph_runner_compiled.backend import CompiledBackend

WAIT_S = 30  # a thread that waits longer has lost its partner: the test fails, never hangs


class HookedCompiler:
    """A Dynamo backend running the traced graph as it is; ``hook`` (when set) runs inside
    every call of the compiled code, that is inside a replay."""

    def __init__(self) -> None:
        self.hook: Optional[Callable[[], None]] = None

    def __call__(self, gm, example_inputs):
        def run(*args):
            if self.hook is not None:
                self.hook()
            return gm.forward(*args)

        return run


def _runner(model, sizes: List[int], compiler) -> DecodeCudaGraphRunner:
    backend = CompiledBackend("cpu", phase="decode", compiler=compiler)
    return DecodeCudaGraphRunner(model, {"decode": {"bs": sizes}}, device="cpu", backend=backend, show_progress=False)


def _eager(model, batch):
    with forward_context(batch):
        return model.compute_logits(type(model).forward(model, batch), batch)


def test_replays_from_two_threads_change_nothing_outside_them():
    torch._dynamo.reset()
    model = ToyModel()
    compilers = [HookedCompiler(), HookedCompiler()]
    runners = [_runner(model, [2], compilers[0]), _runner(model, [4], compilers[1])]
    with torch.no_grad():
        for runner in runners:
            runner.capture()

    @torch.compile(backend="eager")
    def branch(x: torch.Tensor, add: bool) -> torch.Tensor:
        return x + 1 if add else x - 1

    x = torch.zeros(2)
    branch(x, True)
    a_inside, checked, b_inside, a_done = (threading.Event() for _ in range(4))
    outside = {}

    def hook_a() -> None:
        a_inside.set()
        assert checked.wait(WAIT_S) and b_inside.wait(WAIT_S)

    def hook_b() -> None:
        b_inside.set()
        assert a_done.wait(WAIT_S)  # A's replay ends first

    compilers[0].hook, compilers[1].hook = hook_a, hook_b
    batches = [decode_batch(2, offset=3), decode_batch(3, offset=5)]
    results: dict = {}
    errors: list = []

    def replay(index: int, before: Optional[threading.Event], after: Optional[threading.Event]) -> None:
        try:
            if before is not None:
                assert before.wait(WAIT_S)
            with torch.no_grad():
                results[index] = runners[index].forward(batches[index]).clone()
            if after is not None:
                after.set()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [
        threading.Thread(target=replay, args=(0, None, a_done)),
        threading.Thread(target=replay, args=(1, checked, None)),
    ]
    for thread in threads:
        thread.start()
    try:
        assert a_inside.wait(WAIT_S)
        # While A replays: this thread's compiled code checks its guards (takes the other
        # branch, compiles it) and the model's forward is its own.
        outside["branch"] = branch(x, False)
        with torch.no_grad():
            outside["forward"] = model.forward(batches[1])
    finally:
        checked.set()
        for thread in threads:
            thread.join(WAIT_S)
    compilers[0].hook = compilers[1].hook = None
    assert not errors, errors
    torch.testing.assert_close(outside["branch"], x - 1)
    torch.testing.assert_close(outside["forward"], type(model).forward(model, batches[1]))
    for index, batch in enumerate(batches):
        torch.testing.assert_close(results[index], _eager(model, batch), msg=f"runner {index}")
    # Afterwards: nothing left behind in the process or on the model.
    torch.testing.assert_close(branch(x, True), x + 1)
    torch.testing.assert_close(torch.compile(lambda t: t * 3, backend="eager")(x + 1), (x + 1) * 3)
    assert "forward" not in model.__dict__
    torch._dynamo.reset()


# A marked op whose body runs compiled code of its own (as FlexAttention's block-mask
# helpers do), specialized to a live host value of the batch.
_scale = torch.compile(lambda x, n: x * n, backend="eager", dynamic=False)


def _scaled_by_context(output: torch.Tensor, x: torch.Tensor) -> None:
    output.copy_(_scale(x, max(get_forward_batch().seq_lens_cpu)))


SCALED_BY_CONTEXT = register_eager_op("compiled_test_scaled_by_context", _scaled_by_context)


class ContextScaledToy(ToyModel):
    def forward(self, batch):
        hidden = super().forward(batch)
        out = torch.empty_like(hidden)
        SCALED_BY_CONTEXT(out, hidden)
        return out


def test_a_marked_op_running_its_own_compiled_code_keeps_its_guards_in_a_replay():
    torch._dynamo.reset()
    model = ContextScaledToy()
    runner = _runner(model, [2], "eager")
    with torch.no_grad():
        runner.capture()
        for extra in (3, 7):  # live lengths the op's compiled code has not seen: it recompiles
            batch = decode_batch(2, offset=extra)
            batch.seq_lens += extra
            batch.seq_lens_cpu = batch.seq_lens.tolist()
            got = runner.forward(batch).clone()  # before eager, which would compile the value first
            torch.testing.assert_close(got, _eager(model, batch), msg=f"lengths +{extra}")
    torch._dynamo.reset()
