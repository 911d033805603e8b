"""The host-value guard (cuda_graph_runner.backend.host_guard) on the CPU, with every backend here.

A model reading a host value of the batch where the backend would freeze it fails at
capture with CudaGraphHostValueError naming the field, the backend and the fixes; reads
inside marked ops (where they run eagerly at replay), on the eager path and in the
metadata hooks stay free; ``host_value_guard: false`` turns it off.
"""

from __future__ import annotations

import pytest
import torch
from host_branch_model import HostBranchLlama, make_model

from cuda_graph_runner.backend.context import get_forward_batch
from cuda_graph_runner.backend.errors import CudaGraphHostValueError
from cuda_graph_runner.backend.forward_batch import StaticForwardBatch, as_static_batch
from cuda_graph_runner.backend.graph_break import eager_op
from cuda_graph_runner.backend.host_guard import GuardedExtra, host_value_guard, is_host_value
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner
from cuda_graph_runner.testing.fakes import FakeGraphDeviceModule, RecordingBackend
from cuda_graph_runner.testing.toy_model import ToyModel, decode_batch
from cuda_graph_runner_breakable.backend import BreakableCudaGraphBackend
from cuda_graph_runner_breakable.emulation import EmulatedGraphDeviceModule
from cuda_graph_runner_full.backend import FullCudaGraphBackend


def full(phase: str = "decode", dm=None) -> FullCudaGraphBackend:
    return FullCudaGraphBackend(
        "cpu", phase=phase, device_module=dm or EmulatedGraphDeviceModule(), memory_pool="pool-0"
    )


def breakable(phase: str = "decode") -> BreakableCudaGraphBackend:
    return BreakableCudaGraphBackend(
        "cpu", phase=phase, device_module=EmulatedGraphDeviceModule(), memory_pool="pool-0"
    )


def tc_piecewise(phase: str = "decode"):
    backend_mod = pytest.importorskip("cuda_graph_runner_tc_piecewise.backend")
    return backend_mod.TcPiecewiseCudaGraphBackend("cpu", phase=phase)


def decode_runner(model, backend, **phase):
    cfg = {"bs": [1, 2, 4], **phase}
    return DecodeCudaGraphRunner(model, {"decode": cfg}, device="cpu", backend=backend, show_progress=False)


def prefill_runner(model, backend, **phase):
    cfg = {"bs": [16, 32], **phase}
    return PrefillCudaGraphRunner(model, {"prefill": cfg}, device="cpu", backend=backend, show_progress=False)


@pytest.fixture(scope="module")
def host_branch():
    return make_model()


@pytest.fixture(scope="module")
def reference():
    from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM

    return make_model(ReferenceLlamaForCausalLM)


# -- the host-branch model is refused at capture -------------------------------------------------


@pytest.mark.parametrize(
    "make_backend, where",
    [
        (full, "records the whole forward"),
        (breakable, "outside a marked eager op"),
    ],
)
def test_host_branch_model_is_refused_at_capture(host_branch, make_backend, where):
    runner = decode_runner(host_branch, make_backend())
    with torch.no_grad(), pytest.raises(CudaGraphHostValueError) as info:
        runner.capture()
    err = info.value
    # Built directly: the registry's name if it has resolved the class before, else the class name.
    label = runner.backend.name or type(runner.backend).__name__
    assert err.field == "seq_lens_cpu" and err.backend == label and err.phase == "decode"
    text = str(err)
    for fragment in (
        "ForwardBatch.seq_lens_cpu",
        where,
        repr(label),
        "device tensors",
        "eager_op",
        "breakable",
        "host_value_guard",
    ):
        assert fragment in text, fragment
    runner.cleanup()


def test_host_branch_model_is_refused_while_tc_piecewise_traces(host_branch):
    backend = tc_piecewise()
    runner = decode_runner(host_branch, backend)
    try:
        with torch.no_grad(), pytest.raises(CudaGraphHostValueError, match="while torch.compile traces") as info:
            runner.capture()
        assert info.value.field == "seq_lens_cpu" and info.value.phase == "decode"
    finally:
        backend.uninstall()


def test_prefill_host_branch_is_refused_by_breakable(host_branch):
    runner = prefill_runner(host_branch, breakable("prefill"))
    with torch.no_grad(), pytest.raises(CudaGraphHostValueError, match="seq_lens_cpu"):
        runner.capture()


@pytest.mark.parametrize("make_backend", [full, breakable])
def test_guard_off_captures_the_host_branch_model(host_branch, make_backend):
    runner = decode_runner(host_branch, make_backend(), host_value_guard=False)
    assert runner.host_value_guard_scope() == "off"
    with torch.no_grad():
        runner.capture()
    assert len(runner.captured_keys) == 3
    runner.cleanup()


def test_guard_off_lets_tc_piecewise_trace_the_host_branch_model(host_branch):
    backend = tc_piecewise()
    try:
        runner = decode_runner(host_branch, backend, host_value_guard=False)
        with torch.no_grad():
            runner.capture()
        assert backend.dynamo_compiles >= 1
    finally:
        backend.uninstall()


# -- what stays free ------------------------------------------------------------------------------


def test_the_reference_model_captures_under_every_backend(reference):
    """Its decode attention uses device metadata only; its prefill attention reads the host
    lengths inside the marked op, which breakable and tc_piecewise run eagerly at replay."""
    with torch.no_grad():
        for backend in (full(), breakable(), RecordingBackend("cpu", phase="decode")):
            decode_runner(reference, backend).capture()
            backend.cleanup()
        prefill_runner(reference, breakable("prefill")).capture()
        for phase, make in (("decode", decode_runner), ("prefill", prefill_runner)):
            backend = tc_piecewise(phase)
            try:
                make(reference, backend).capture()
            finally:
                backend.uninstall()


def test_eager_path_and_metadata_hooks_read_freely(host_branch):
    seen = []

    class Hooked(HostBranchLlama):
        def init_forward_metadata_capture(self, batch):
            seen.append(("capture", list(batch.seq_lens_cpu)))

    model = make_model(Hooked)
    runner = decode_runner(model, full(), host_value_guard=False)
    with torch.no_grad():
        runner.capture()
    assert [s[0] for s in seen] == ["capture"] * 3 and seen[0][1] == [1, 1, 1, 1]
    # A batch no graph covers (6 > 4) runs eagerly: the model's host read is free there.
    big = decode_batch(6)
    assert not runner.can_run(big)
    with torch.no_grad():
        runner.forward(big)


def test_a_marked_op_read_is_free_only_where_marked_ops_run_eagerly():
    """breakable re-runs marked ops at replay: reads inside them are free. full records them
    into the graph: there the same read would be frozen, and is refused."""

    @eager_op("test_host_guard_scale_by_host_len")
    def scale_by_len(output: torch.Tensor, x: torch.Tensor) -> None:
        lens = get_forward_batch().seq_lens_cpu
        output.copy_(x * float(max(lens)))

    class OpModel(ToyModel):
        def forward(self, batch):
            h = super().forward(batch)
            out = torch.empty_like(h)
            scale_by_len(out, h)
            return out

    with torch.no_grad():
        decode_runner(OpModel(), breakable()).capture()
        with pytest.raises(CudaGraphHostValueError, match="marked ops included") as info:
            decode_runner(OpModel(), full()).capture()
        assert info.value.backend in ("full", "FullCudaGraphBackend")


def test_warmups_and_fake_graph_module_are_guarded_too(host_branch):
    """With the recording fake (replays compute nothing) the error comes from the first warm-up."""
    dm = FakeGraphDeviceModule()
    runner = decode_runner(host_branch, full(dm=dm))
    with torch.no_grad(), pytest.raises(CudaGraphHostValueError):
        runner.capture()
    assert "capture_begin" not in dm.names()


# -- the batch type and the extra rule --------------------------------------------------------------


def test_static_batch_guards_host_fields_and_extra_host_values():
    batch = as_static_batch(decode_batch(2))
    batch.extra = {"lens": [3, 4], "n": 2, "flag": True, "host_t": torch.ones(2), "name": "x", "none": None}
    assert isinstance(batch, StaticForwardBatch) and batch.seq_lens_cpu == [6, 7]
    with host_value_guard("acme", "decode", "forward"):
        for field in ("seq_lens_cpu", "extend_seq_lens_cpu", "extend_prefix_lens_cpu"):
            with pytest.raises(CudaGraphHostValueError, match=f"ForwardBatch.{field}.*'acme'"):
                getattr(batch, field)
        extra = batch.extra
        assert isinstance(extra, GuardedExtra) and "lens" in extra and len(extra) == 6
        for key in ("lens", "n", "flag"):
            with pytest.raises(CudaGraphHostValueError, match=rf"extra\['{key}'\]"):
                extra[key]
        # On a CPU runner a CPU tensor is a device tensor; strings and None are not host values.
        assert extra["name"] == "x" and extra["none"] is None and extra["host_t"].shape == (2,)
        extra["written"] = 1  # writes go through to the batch's dict
        repr(batch), batch.replace(num_tokens_per_req=1)  # never count as reads
    assert batch.extra["written"] == 1 and isinstance(batch.extra, dict)
    assert batch.seq_lens_cpu == [6, 7]  # free again outside the guard


def test_is_host_value_rule():
    cuda_like = torch.device("meta")
    assert is_host_value(3, cuda_like) and is_host_value(2.5, cuda_like) and is_host_value([1], cuda_like)
    assert is_host_value((1,), cuda_like) and is_host_value(torch.ones(1), cuda_like)  # CPU tensor, meta batch
    assert not is_host_value(torch.ones(1, device="meta"), cuda_like)
    assert not is_host_value("x", cuda_like) and not is_host_value(None, cuda_like)
    assert not is_host_value(torch.ones(1), torch.device("cpu"))


def test_unknown_backend_scope_is_named():
    backend = RecordingBackend("cpu", phase="decode")
    backend.host_value_guard = "sometimes"
    runner = decode_runner(ToyModel(), backend)
    with pytest.raises(ValueError, match="'sometimes'.*forward, outside_marked_ops, trace, off"):
        runner.capture()


def test_runner_batches_are_static_batches():
    runner = decode_runner(ToyModel(), RecordingBackend("cpu", phase="decode"))
    with torch.no_grad():
        runner.capture()
        key, static = runner.replay_prepare(decode_batch(3))
    assert isinstance(static, StaticForwardBatch) and static.seq_lens_cpu[-1] == runner.seq_len_fill_value
    assert isinstance(runner.capture_prepare(2), StaticForwardBatch)


class ExtraScaleToy(ToyModel):
    """Reads a Python number an engine put in ``extra`` (in the metadata hook) inside the forward."""

    def init_forward_metadata_capture(self, batch):
        batch.extra["scale"] = 2

    def forward(self, batch):
        return super().forward(batch) * batch.extra["scale"]


@pytest.mark.parametrize("make_backend", [full, breakable, tc_piecewise])
def test_a_host_value_in_extra_is_guarded_on_every_backend(make_backend):
    backend = make_backend()
    runner = decode_runner(ExtraScaleToy(), backend)
    try:
        with torch.no_grad(), pytest.raises(CudaGraphHostValueError, match=r"ForwardBatch.extra\['scale'\]") as info:
            runner.capture()
        assert info.value.field == "extra['scale']"
    finally:
        getattr(backend, "uninstall", backend.cleanup)()


class TemperatureToy(ToyModel):
    """Reads an engine key the capture batch lacks, with a default (or a membership test)."""

    def __init__(self, lookup: str = "get") -> None:
        super().__init__()
        self.lookup = lookup

    def compute_logits(self, hidden, batch):
        logits = super().compute_logits(hidden, batch)
        if self.lookup == "get":
            return logits / batch.extra.get("temperature", 1.0)
        return logits / batch.extra["temperature"] if "temperature" in batch.extra else logits


@pytest.mark.parametrize("make_backend,lookup", [(full, "get"), (breakable, "in"), (RecordingBackend, "get")])
def test_an_extra_key_the_capture_lacked_is_refused_at_replay_never_frozen(make_backend, lookup):
    runner = decode_runner(
        TemperatureToy(lookup), make_backend() if make_backend is not RecordingBackend else RecordingBackend("cpu")
    )
    with torch.no_grad():
        runner.capture()
        plain = decode_batch(3)
        torch.testing.assert_close(runner.forward(plain), runner.eager_forward(plain))  # no key: replays
        hot = decode_batch(3)
        hot.extra["temperature"] = 2.0
        for call in (runner.forward, runner.replay):
            with pytest.raises(CudaGraphHostValueError, match=r"extra holds 'temperature'.*static input") as info:
                call(hot)
            assert info.value.field == "extra['temperature']" and info.value.phase == "decode"


def test_an_extra_key_read_only_inside_a_marked_op_replays_with_breakable():
    @eager_op("test_host_guard_scale_by_temperature")
    def scale(output: torch.Tensor, x: torch.Tensor) -> None:
        output.copy_(x / get_forward_batch().extra.get("temperature", 1.0))

    class OpModel(ToyModel):
        def forward(self, batch):
            h = super().forward(batch)
            out = torch.empty_like(h)
            scale(out, h)
            return out

    runner = decode_runner(OpModel(), breakable())
    with torch.no_grad():
        runner.capture()
        hot = decode_batch(3)
        hot.extra["temperature"] = 2.0
        torch.testing.assert_close(runner.forward(hot), runner.eager_forward(hot))
        assert runner.run_stats()["replays"] == 1
