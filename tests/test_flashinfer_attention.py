"""The ``flashinfer`` attention on CPU, with a fake of FlashInfer's wrapper API.

The fake (:class:`FakeFlashInfer`) checks what the real wrappers need: plans from host
tensors only, graph wrappers at a fixed batch size with their buffers, page ids in the
index buffer; its ``run`` computes attention from the *planned* buffers only (static
shapes, so emulated graphs replay it), so a stale or missing plan gives wrong numbers;
its ``plan`` simulates the asynchronous copy from the pinned host buffer on a stream
that only advances when an event is waited on (a device infinitely far behind), and
raises when a plan overwrites a pinned buffer whose copy is still pending; its plans and
runs check the ranges the real kernels rely on and never check themselves (indptr from 0,
never decreasing, within the page ids; each request's query tokens within its KV: a
plan raises :class:`OutOfRange`; page ids within the cache's slots: a run asserts on
the device, recorded into graphs too), where CUDA gives an illegal address or a
device-side assert.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, List

import pytest
import torch
import torch.nn.functional as F

from cuda_graph_runner.backend.context import forward_context
from cuda_graph_runner.backend.forward_batch import ForwardMode
from cuda_graph_runner.backend.weak_ref import weak_ref_tensors
from cuda_graph_runner.reference.batches import eager_logits_fn, make_dummy_prompts, make_extend_batch
from cuda_graph_runner.reference.model import ATTENTION_BACKENDS, PRESETS, ReferenceLlamaForCausalLM
from cuda_graph_runner.reference.model import flashinfer_attention as fia
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner
from cuda_graph_runner.testing.reference_setup import staggered_decode_case
from cuda_graph_runner.testing.tolerances import model_tolerance
from cuda_graph_runner_breakable.backend import BreakableCudaGraphBackend
from cuda_graph_runner_breakable.emulation import EmulatedGraphDeviceModule
from cuda_graph_runner_full.backend import FullCudaGraphBackend

CONTEXT = 48
#: The tiny preset with a head dim FlashInfer has kernels for.
CONFIG = dataclasses.replace(
    PRESETS["tiny"], hidden_size=128, head_dim=64, num_attention_heads=2, num_key_value_heads=1
)
TOL = model_tolerance(CONFIG, torch.bfloat16, context_len=CONTEXT)


class PinnedBufferRace(AssertionError):
    """A plan overwrote a pinned buffer whose asynchronous copy had not run."""


class FakeStream:
    def __init__(self) -> None:
        self.enqueued = 0
        self.completed = 0
        self.pending: List[tuple] = []  # (sequence number, pinned buffer data_ptr)

    def copy_from(self, buffer: torch.Tensor) -> None:
        ptr = buffer.data_ptr()
        if any(p == ptr for _, p in self.pending):
            raise PinnedBufferRace(f"plan overwrote pinned buffer {ptr:#x} while its copy is pending")
        self.enqueued += 1
        self.pending.append((self.enqueued, ptr))

    def complete(self, upto: int) -> None:
        self.completed = max(self.completed, upto)
        self.pending = [(n, p) for n, p in self.pending if n > upto]


class FakeEvent:
    stream: FakeStream
    waits = 0  # device-side waits of a stream on this event

    def record(self) -> None:
        self.seq = self.stream.enqueued

    def wait(self) -> None:
        self.waits += 1

    def query(self) -> bool:
        return self.stream.completed >= self.seq

    def synchronize(self) -> None:
        self.stream.complete(self.seq)


def _host(t: torch.Tensor, what: str) -> torch.Tensor:
    assert t.device.type == "cpu", f"{what} must be a host tensor (a device one costs a device-to-host copy)"
    return t


class OutOfRange(AssertionError):
    """A plan or run the real kernels would take out of range (an illegal address or a
    device-side assert on CUDA, never an error they raise)."""


def _check_indptr(indptr: torch.Tensor, what: str, entries: int) -> List[int]:
    """``indptr`` as a list: starts at 0, never decreases, ends within ``entries``."""
    v = [int(x) for x in indptr.tolist()]
    if not v or v[0] != 0 or any(b < a for a, b in zip(v, v[1:])):
        raise OutOfRange(f"{what} {v} must start at 0 and never decrease")
    if v[-1] > entries:
        raise OutOfRange(f"{what} ends at {v[-1]}, past the {entries} entries it indexes")
    return v


def _check_slots(indices: torch.Tensor, used: Any, num_slots: int, what: str) -> None:
    """The first ``used`` (an int, or a 0-d device tensor) page ids of ``indices`` are KV
    slots of the cache run over: a device-side assert (no host read, so a graph records
    it and every replay checks again; on the CPU it raises a RuntimeError at once)."""
    live = torch.arange(indices.numel()) < used
    ok = (~live | ((indices >= 0) & (indices < num_slots))).all()
    torch._assert_async(ok, f"{what}: a page id outside the KV cache's {num_slots} slots")


CALLS: List[tuple] = []  # (wrapper kind, method, args, kwargs) of every call the backend made


def _recorded(kind: str) -> Any:
    def wrap(method: Any) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            CALLS.append((kind, method.__name__, args, kwargs))
            return method(self, *args, **kwargs)

        return call

    return wrap


class _Wrapper:
    stream: FakeStream
    log: List[dict]

    def __init__(self) -> None:
        self._pin_memory_int_workspace_buffer = torch.zeros(64, dtype=torch.uint8)

    def _copy(self) -> None:
        self._pin_memory_int_workspace_buffer.fill_(len(self.log) % 251)  # the host half of plan()
        self.stream.copy_from(self._pin_memory_int_workspace_buffer)


class FakeDecodeWrapper(_Wrapper):
    @_recorded("decode")
    def __init__(self, workspace, layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None):  # fmt: skip
        super().__init__()
        assert layout == "NHD"
        self.graph = use_cuda_graph
        self.use_tensor_cores = use_tensor_cores
        if use_cuda_graph:
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
        self.indptr, self.indices, self.last = (
            paged_kv_indptr_buffer,
            paged_kv_indices_buffer,
            paged_kv_last_page_len_buffer,
        )

    @_recorded("decode")
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             window_left=-1, q_data_type=None, kv_data_type=None, sm_scale=None, non_blocking=True):  # fmt: skip
        _host(indptr, "indptr")
        _host(last_page_len, "last_page_len")
        assert page_size == 1 and q_data_type in (torch.bfloat16, torch.float16)
        entries = self.indices.numel() if self.graph else indices.numel()
        _check_indptr(indptr, "decode indptr", entries)
        if len(last_page_len) != len(indptr) - 1 or not bool((last_page_len == 1).all()):
            raise OutOfRange(f"last_page_len {last_page_len.tolist()} for {len(indptr) - 1} requests of page size 1")
        self.log.append({"kind": "decode", "graph": self.graph, "indptr": indptr.tolist(), "wrapper": self,
                         "tc": self.use_tensor_cores})  # fmt: skip
        if self.graph:
            assert len(last_page_len) == len(self.last), "batch size fixed in cudagraph mode"
            self.indptr.copy_(indptr)
            self.last.copy_(last_page_len)
            self.indices[: len(indices)].copy_(indices)
        else:
            self.indptr, self.indices, self.last = indptr.clone(), indices.clone(), last_page_len.clone()
            self.ctx = int((indptr[1:] - indptr[:-1]).max())
        self.scale, self.window = sm_scale, window_left
        self._copy()

    @_recorded("decode")
    def run(self, q, kv, out):
        # Static shapes from the buffers only: emulated graphs replay these ops as recorded.
        k_cache, v_cache = kv[0][:, 0], kv[1][:, 0]
        bs, heads, d = q.shape
        if bs != len(self.indptr) - 1:
            raise OutOfRange(f"decode run of {bs} queries, planned for {len(self.indptr) - 1} requests")
        _check_slots(self.indices, self.indptr[-1], k_cache.shape[0], "decode run")
        ctx = self.indices.numel() // bs if self.graph else self.ctx
        starts, lens = self.indptr[:-1].long(), (self.indptr[1:] - self.indptr[:-1]).long()
        j = torch.arange(ctx)
        pos = (starts[:, None] + j[None, :]).clamp(max=self.indices.numel() - 1)
        slots = self.indices.long()[pos]  # [bs, ctx]
        mask = j[None, :] < lens[:, None]
        if self.window >= 0:
            mask &= j[None, :] >= lens[:, None] - 1 - self.window
        group = heads // k_cache.shape[1]
        k = k_cache[slots].repeat_interleave(group, dim=2).permute(0, 2, 1, 3)  # [bs, heads, ctx, d]
        v = v_cache[slots].repeat_interleave(group, dim=2).permute(0, 2, 1, 3)
        o = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask[:, None, None], scale=self.scale)
        out.copy_(o[:, :, 0])


class FakePrefillWrapper(_Wrapper):
    @_recorded("prefill")
    def __init__(self, workspace, layout="NHD"):
        super().__init__()

    @_recorded("prefill")
    def plan(self, qo_indptr, kv_indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             causal, sm_scale, window_left, q_data_type, kv_data_type, non_blocking):  # fmt: skip
        _host(qo_indptr, "qo_indptr")
        _host(kv_indptr, "paged_kv_indptr")
        assert causal and page_size == 1
        qo = _check_indptr(qo_indptr, "qo_indptr", 1 << 62)
        kv = _check_indptr(kv_indptr, "paged_kv_indptr", indices.numel())
        if len(qo) != len(kv) or len(last_page_len) != len(kv) - 1 or not bool((last_page_len == 1).all()):
            raise OutOfRange(f"qo_indptr {qo}, paged_kv_indptr {kv}, last_page_len {last_page_len.tolist()}")
        for i in range(len(qo) - 1):
            if qo[i + 1] - qo[i] > kv[i + 1] - kv[i]:  # causal: the new tokens are the last of the KV
                raise OutOfRange(f"request {i}: {qo[i + 1] - qo[i]} query tokens over {kv[i + 1] - kv[i]} KV tokens")
        self.log.append({"kind": "prefill", "qo": qo_indptr.tolist(), "kv": kv_indptr.tolist()})
        self.qo, self.kv, self.indices = qo_indptr.tolist(), kv_indptr.tolist(), indices.clone()
        self.scale, self.window = sm_scale, window_left
        self._copy()

    @_recorded("prefill")
    def run(self, q, kv, out):
        k_cache, v_cache = kv[0][:, 0], kv[1][:, 0]
        heads = q.shape[1]
        if self.qo[-1] > q.shape[0]:
            raise OutOfRange(f"prefill run of {q.shape[0]} query tokens, planned for {self.qo[-1]}")
        _check_slots(self.indices, self.kv[-1], k_cache.shape[0], "prefill run")
        for i in range(len(self.qo) - 1):
            q0, q1, k0, k1 = self.qo[i], self.qo[i + 1], self.kv[i], self.kv[i + 1]
            n, m = q1 - q0, k1 - k0
            slots = self.indices[k0:k1].long()
            k = k_cache[slots].repeat_interleave(heads // k_cache.shape[1], dim=1).transpose(0, 1)
            v = v_cache[slots].repeat_interleave(heads // k_cache.shape[1], dim=1).transpose(0, 1)
            qp = torch.arange(m - n, m)[:, None]
            kp = torch.arange(m)[None, :]
            mask = kp <= qp
            if self.window >= 0:
                mask &= kp >= qp - self.window
            o = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1), k, v, attn_mask=mask, scale=self.scale)
            out[q0:q1] = o.transpose(0, 1)


@pytest.fixture
def fake(monkeypatch):
    """Installs the fake ``flashinfer`` module and the backends built on it; yields its plan log."""
    stream, log = FakeStream(), []
    module = types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=type("D", (FakeDecodeWrapper,), {"stream": stream, "log": log}),
        BatchPrefillWithPagedKVCacheWrapper=type("P", (FakePrefillWrapper,), {"stream": stream, "log": log}),
    )
    monkeypatch.setattr(fia, "_flashinfer", lambda: module)
    event = type("E", (FakeEvent,), {"stream": stream})
    for name, tc in (("flashinfer", False), ("flashinfer_tc", True)):
        monkeypatch.setitem(
            ATTENTION_BACKENDS,
            name,
            lambda tc=tc: fia.FlashInferAttention(use_tensor_cores=tc, workspace_bytes=64, event_factory=event),
        )
    return types.SimpleNamespace(log=log, stream=stream, event=event)


def fi_model(attention: str = "flashinfer", dtype: torch.dtype = torch.bfloat16) -> ReferenceLlamaForCausalLM:
    model = ReferenceLlamaForCausalLM.from_config(CONFIG, dtype=dtype, attention=attention)
    model.create_kv_cache(num_slots=12 * CONTEXT + 1, max_reqs=13, max_context_len=CONTEXT)
    return model


def torch_twin(model: ReferenceLlamaForCausalLM) -> ReferenceLlamaForCausalLM:
    twin = ReferenceLlamaForCausalLM.from_config(CONFIG, dtype=model.dtype, attention="torch")
    twin.load_state_dict(model.state_dict())
    twin.attach_kv_cache(model.kv_cache)  # type: ignore[arg-type]
    return twin


def test_the_names_and_a_missing_package_is_a_clear_error(monkeypatch):
    assert {"flashinfer", "flashinfer_tc"} <= set(ATTENTION_BACKENDS)
    monkeypatch.setattr(fia, "flashinfer_available", lambda: False)
    with pytest.raises(ValueError, match=r"not installed: pip install 'cuda-graph-runner\[flashinfer\]'"):
        ReferenceLlamaForCausalLM.from_preset("tiny", attention="flashinfer")
    monkeypatch.setattr(fia, "flashinfer_available", lambda: True)

    def broken() -> None:
        raise ModuleNotFoundError("No module named 'pynvml'")

    monkeypatch.setattr(fia, "_flashinfer", broken)
    with pytest.raises(ValueError, match=r"'flashinfer_tc': importing flashinfer failed \(ModuleNotFoundError: No mod"):
        ReferenceLlamaForCausalLM.from_preset("tiny", attention="flashinfer_tc")


def test_float32_and_other_head_dims_are_refused_naming_what_is_accepted(fake):
    model = fi_model(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"no torch.float32 kernels; FlashInfer takes torch.bfloat16, torch.float16"):
        staggered_decode_case(model, 2, seed=0)
    model = ReferenceLlamaForCausalLM.from_preset("tiny", dtype=torch.bfloat16, attention="flashinfer")
    model.create_kv_cache(num_slots=4 * CONTEXT + 1, max_reqs=5, max_context_len=CONTEXT)
    with pytest.raises(ValueError, match=r"head_dim=16 has no FlashInfer kernels; accepted: 64, 128, 256"):
        staggered_decode_case(model, 2, seed=0)


@pytest.mark.parametrize("attention", ["flashinfer", "flashinfer_tc"])
def test_eager_extend_and_decode_equal_torch_attention(fake, attention):
    model = fi_model(attention)
    twin = torch_twin(model)
    # Ragged prompts, then a second chunk over their cached prefixes, then decode.
    prompts = make_dummy_prompts(3, [5, 9, 3], model.config.vocab_size, seed=1)
    first = make_extend_batch(model.kv_cache, [list(p[:3]) for p in prompts])
    with torch.no_grad():
        got = eager_logits_fn(model)(first).clone()
        torch.testing.assert_close(got, eager_logits_fn(twin)(first), **TOL)
    fake.log.clear()
    session, batch, expected = staggered_decode_case(twin, 4, seed=2, decode_steps=2)
    with torch.no_grad():
        torch.testing.assert_close(eager_logits_fn(model)(batch), expected, **TOL)
    decode_plans = [p for p in fake.log if p["kind"] == "decode"]
    assert decode_plans[-1]["indptr"] == [0, *torch.tensor(batch.seq_lens_cpu).cumsum(0).tolist()]
    assert all(p["tc"] is (attention == "flashinfer_tc") for p in decode_plans)
    session.close()


def _runner(model: Any, name: str) -> DecodeCudaGraphRunner:
    device_module = EmulatedGraphDeviceModule()
    cls = {"full": FullCudaGraphBackend, "breakable": BreakableCudaGraphBackend}[name]
    return DecodeCudaGraphRunner(
        model, {"decode": {"bs": [1, 2, 4]}}, device="cpu",
        backend=cls("cpu", phase="decode", device_module=device_module, memory_pool="pool-0"), show_progress=False,
    )  # fmt: skip


@pytest.mark.parametrize("name", ["full", "breakable"])
def test_decode_replays_plan_from_the_padded_host_lengths_and_equal_eager(fake, name):
    model = fi_model()
    backend = model.attn_backend
    assert isinstance(backend, fia.FlashInferAttention)
    runner = _runner(model, name)
    with torch.no_grad():
        runner.capture()
        keys = {(ForwardMode.DECODE, 1, bs, "") for bs in (1, 2, 4)}
        assert set(backend.states) == keys and all(backend.state_builds[k] == 1 for k in keys)
        wrappers = {k: s.wrapper for k, s in backend.states.items()}
        for bs, steps in ((3, 1), (2, 2), (4, 3), (1, 1), (3, 3)):  # padded and captured sizes, growing
            session, batch, expected = staggered_decode_case(model, bs, seed=bs + steps, decode_steps=steps)
            fake.log.clear()
            got = runner.forward(batch)
            torch.testing.assert_close(got, expected, **TOL, msg=f"{name}: batch size {bs}")
            padded = runner.padded_size(bs)
            lens = batch.seq_lens_cpu + [runner.seq_len_fill_value] * (padded - bs)
            (plan,) = [p for p in fake.log if p["kind"] == "decode"]
            key = (ForwardMode.DECODE, 1, padded, "")
            assert plan["graph"] and plan["wrapper"] is wrappers[key]  # the recorded wrapper, re-planned
            assert plan["indptr"] == [0, *torch.tensor(lens).cumsum(0).tolist()]
            assert backend.plan_log[-1][:2] == ("replay", key)
            session.close()
        runner.cleanup()
        assert not backend.states
        with pytest.raises(fia.FlashInferPlanError, match="no wrapper"):
            model.init_forward_metadata_replay(runner.capture_prepare(2))


def test_replay_plans_never_read_the_device_lengths(fake):
    model = fi_model()
    runner = _runner(model, "full")
    with torch.no_grad():
        runner.capture()
        session, batch, expected = staggered_decode_case(model, 2, seed=7)
        static = runner.capture_prepare(2)
        static.seq_lens_cpu = list(batch.seq_lens_cpu)
        static.seq_lens.fill_(CONTEXT)  # wrong on the device: the plan must not look at it
        static.req_pool_indices.copy_(batch.req_pool_indices)
        fake.log.clear()
        model.init_forward_metadata_replay(static)
        assert fake.log[-1]["indptr"] == [0, batch.seq_lens_cpu[0], sum(batch.seq_lens_cpu)]
        state = model.attn_backend.states[(ForwardMode.DECODE, 1, 2, "")]
        table = model.kv_cache.req_to_token
        want = [int(table[r, c]) for r, n in zip(batch.req_pool_indices.tolist(), batch.seq_lens_cpu) for c in range(n)]
        assert state.indices[: len(want)].tolist() == want  # page ids written into the wrapper's buffer
        session.close()


def test_a_plan_waits_for_the_copy_of_its_pinned_buffer(fake):
    decode = fia._flashinfer().BatchDecodeWithPagedKVCacheWrapper(None)
    args = (
        torch.tensor([0, 1], dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        torch.ones(1, dtype=torch.int32),
    )
    decode.plan(*args, 1, 1, 4, 1, q_data_type=torch.bfloat16)
    with pytest.raises(PinnedBufferRace):  # the fake catches two plans on one buffer with a pending copy
        decode.plan(*args, 1, 1, 4, 1, q_data_type=torch.bfloat16)
    # Through the backend: replays back to back with the device never catching up on its own.
    model = fi_model()
    runner = _runner(model, "full")
    with torch.no_grad():
        runner.capture()
        session, batch, expected = staggered_decode_case(model, 2, seed=9)
        for _ in range(5):
            torch.testing.assert_close(runner.forward(batch), expected, **TOL)
        session.close()
    assert model.attn_backend.pinned_ring.waits > 0  # it did wait, and no plan raced


def test_extend_through_the_breakable_prefill_runner_equals_torch(fake):
    model = fi_model()
    twin = torch_twin(model)
    device_module = EmulatedGraphDeviceModule()
    runner = PrefillCudaGraphRunner(
        model, {"prefill": {"bs": [16, 32]}}, device="cpu",
        backend=BreakableCudaGraphBackend("cpu", phase="prefill", device_module=device_module, memory_pool="pool-0"),
        show_progress=False,
    )  # fmt: skip
    with torch.no_grad():
        runner.capture()
        prompts = make_dummy_prompts(3, [4, 7, 2], model.config.vocab_size, seed=3)
        batch = make_extend_batch(model.kv_cache, [list(p) for p in prompts])
        fake.log.clear()
        got = runner.forward(batch).clone()
        torch.testing.assert_close(got, eager_logits_fn(twin)(batch), **TOL)
    assert [p["qo"] for p in fake.log if p["kind"] == "prefill"][0] == [0, 4, 11, 13]


@pytest.mark.skipif(not fia.flashinfer_available(), reason="needs flashinfer-python (cuda-graph-runner[flashinfer])")
@pytest.mark.parametrize("attention", ["flashinfer", "flashinfer_tc"])
def test_the_calls_made_to_the_fakes_bind_to_flashinfers_own_signatures(fake, attention):
    import inspect

    import flashinfer

    CALLS.clear()
    model = fi_model(attention)
    prompts = make_dummy_prompts(2, [5, 3], model.config.vocab_size, seed=1)
    runner = _runner(model, "full")
    with torch.no_grad():
        eager_logits_fn(model)(make_extend_batch(model.kv_cache, prompts))  # eager prefill
        runner.capture()  # graph wrappers, capture plans
        session, batch, _ = staggered_decode_case(model, 3, seed=2)  # eager decode
        runner.forward(batch)  # a replay plan
        session.close()
    real = {
        "decode": flashinfer.BatchDecodeWithPagedKVCacheWrapper,
        "prefill": flashinfer.BatchPrefillWithPagedKVCacheWrapper,
    }
    assert {(kind, method) for kind, method, _, _ in CALLS} == {
        (k, m) for k in real for m in ("__init__", "plan", "run")
    }
    for kind, method, args, kwargs in CALLS:
        inspect.signature(getattr(real[kind], method)).bind(None, *args, **kwargs)  # TypeError on a mismatch


def test_an_eager_plan_over_another_caches_table_is_made_again(fake):
    model = fi_model()
    session, batch, expected = staggered_decode_case(model, 2, seed=4)
    session.close()
    model.create_kv_cache(num_slots=6 * CONTEXT + 1, max_reqs=7, max_context_len=CONTEXT)  # a new table
    twin = torch_twin(model)
    session, batch, expected = staggered_decode_case(twin, 3, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(eager_logits_fn(model)(batch), expected, **TOL)
    session.close()


def test_run_py_refuses_a_missing_attention_package_before_any_work(monkeypatch, tmp_path, capsys):
    import os

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import run

    monkeypatch.setattr(fia, "flashinfer_available", lambda: False)
    out = tmp_path / "out"
    assert run.main(["--device", "cpu", "--attention", "flashinfer", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "attention='flashinfer' needs the flashinfer-python package" in err and "Traceback" not in err
    assert not out.exists()  # nothing was written


def _breakable_prefill(model: Any, *, alias_args: bool, sizes: tuple = (16, 32)) -> PrefillCudaGraphRunner:
    backend = BreakableCudaGraphBackend(
        "cpu", phase="prefill", device_module=EmulatedGraphDeviceModule(), memory_pool="pool-0"
    )
    if alias_args:
        # What breakable does to CUDA arguments of an eager break: non-owning aliases, new
        # tensor objects over the same memory (the KV cache, req_to_token).
        backend.freeze = weak_ref_tensors  # type: ignore[method-assign]
    return PrefillCudaGraphRunner(
        model, {"prefill": {"bs": list(sizes)}}, device="cpu", backend=backend, show_progress=False
    )


def test_a_breakable_prefill_replay_over_aliased_arguments_runs_the_hooks_plan(fake):
    model = fi_model()
    twin = torch_twin(model)
    backend = model.attn_backend
    assert isinstance(backend, fia.FlashInferAttention)
    runner = _breakable_prefill(model, alias_args=True)
    table = model.kv_cache.req_to_token
    with torch.no_grad():
        runner.capture()
        for lengths in ([4, 7, 2], [16], [9, 9]):  # padded, on a bucket, padded again
            batch = make_extend_batch(model.kv_cache, make_dummy_prompts(len(lengths), lengths, 256, seed=len(lengths)))
            start = len(backend.plan_log)
            got = runner.forward(batch).clone()
            torch.testing.assert_close(got, eager_logits_fn(twin)(batch), **TOL, msg=str(lengths))
            # The replay hook's plan served every layer: the op found it made for this batch
            # (same table by storage, though its argument is another tensor object).
            assert [k for k, _, _ in list(backend.plan_log)[start:]] == ["replay"], lengths
        assert backend.req_to_token is table  # the owning table is kept, never the alias
        # An eager decode after it is planned once (its plan was made over the same table).
        session, batch, expected = staggered_decode_case(model, 2, seed=3)
        start = len(backend.plan_log)
        torch.testing.assert_close(eager_logits_fn(model)(batch), expected, **TOL)
        assert [k for k, _, _ in list(backend.plan_log)[start:]] == ["eager"]
        session.close()


def test_a_plan_key_compares_no_tensor_and_tells_tables_and_rows_apart():
    table = torch.zeros(4, 8, dtype=torch.int64)
    batch = types.SimpleNamespace(req_pool_indices=torch.tensor([1, 2]))
    key = fia._prefill_key(batch, [3, 4], [0, 1], table)  # type: ignore[arg-type]
    assert key == fia._prefill_key(batch, [3, 4], [0, 1], weak_ref_tensors(table))  # type: ignore[arg-type]
    assert key != fia._prefill_key(batch, [3, 4], [0, 1], table.clone())  # type: ignore[arg-type]
    other_rows = types.SimpleNamespace(req_pool_indices=torch.tensor([1, 2]))
    assert key != fia._prefill_key(other_rows, [3, 4], [0, 1], table)  # type: ignore[arg-type]
    assert all(not isinstance(x, torch.Tensor) for x in key)


def test_a_plan_that_raises_still_guards_its_pinned_buffer(fake, monkeypatch):
    model = fi_model()
    session, batch, expected = staggered_decode_case(model, 2, seed=6)  # the geometry is learnt
    backend = model.attn_backend
    assert isinstance(backend, fia.FlashInferAttention) and backend._eager_decode is not None
    cls = type(backend._eager_decode.wrapper)
    real_plan, fail = cls.plan, []

    def plan(self: Any, *args: Any, **kwargs: Any) -> None:
        real_plan(self, *args, **kwargs)  # its copy is enqueued
        if fail:
            raise RuntimeError("plan failed after its copy was enqueued")

    monkeypatch.setattr(cls, "plan", plan)
    with torch.no_grad():
        model.init_forward_metadata(batch)
        model.init_forward_metadata(batch)
        fail.append(True)
        with pytest.raises(RuntimeError, match="plan failed"):
            model.init_forward_metadata(batch)  # its buffer's copy stays pending on the device
        fail.clear()
        waits = backend.pinned_ring.waits
        model.init_forward_metadata(batch)
        model.init_forward_metadata(batch)  # that buffer again: waits for the failed plan's copy
        assert backend.pinned_ring.waits == waits + 2
        torch.testing.assert_close(eager_logits_fn(model)(batch), expected, **TOL)
    session.close()


def test_plans_and_runs_on_two_streams_are_ordered(fake, monkeypatch):
    model = fi_model()
    twin = torch_twin(model)
    backend = model.attn_backend
    assert isinstance(backend, fia.FlashInferAttention)
    stream = {"id": 2}
    monkeypatch.setattr(fia, "_stream_id", lambda: stream["id"])

    def kinds_of(step: Any) -> List[str]:
        start = len(backend.plan_log)
        step()
        return [k for k, _, _ in list(backend.plan_log)[start:]]

    def forward_without_hook() -> None:
        with forward_context(batch):
            outputs.append(model.compute_logits(model.forward(batch), batch))

    outputs: List[torch.Tensor] = []
    batch = make_extend_batch(model.kv_cache, make_dummy_prompts(2, [5, 3], model.config.vocab_size, seed=8))
    with torch.no_grad():
        outputs.append(eager_logits_fn(model)(batch))  # the first forward: the geometry is learnt
        assert kinds_of(lambda: outputs.append(eager_logits_fn(model)(batch))) == ["eager"]  # planned, run on 2
        event, _ = backend._runs[backend._prefill]
        waits = event.waits
        stream["id"] = 1
        assert kinds_of(lambda: model.init_forward_metadata(batch)) == ["eager"]  # a hook on stream 1 ...
        assert event.waits == waits + 1  # ... waits on the device for the runs of stream 2 first
        stream["id"] = 2
        assert kinds_of(forward_without_hook) == ["forward"]  # stream 1's plan is not run on stream 2
        assert kinds_of(lambda: model.init_forward_metadata(batch)) == ["eager"]
        assert kinds_of(forward_without_hook) == []  # one stream: the hook's plan serves
    expected = eager_logits_fn(twin)(batch)
    for got in outputs:
        torch.testing.assert_close(got, expected, **TOL)


def test_an_extend_or_eager_decode_recorded_into_a_graph_is_refused(fake, monkeypatch):
    model = fi_model()
    batch = make_extend_batch(model.kv_cache, make_dummy_prompts(2, [5, 3], model.config.vocab_size, seed=9))
    with torch.no_grad():
        eager_logits_fn(model)(batch)  # the geometry is learnt
        monkeypatch.setattr(fia, "_capturing", lambda: True)  # as under a graph capture of `full`
        with pytest.raises(fia.FlashInferPlanError, match=r"extend forward of a live batch is being recorded"):
            eager_logits_fn(model)(batch)
        session, decode, _ = staggered_decode_case(torch_twin(model), 2, seed=9)
        with pytest.raises(fia.FlashInferPlanError, match=r"decode forward of a live batch is being recorded"):
            eager_logits_fn(model)(decode)
        session.close()


def _prefill_section_after_decode(model: Any, tokens: List[int], counts: List[int]) -> dict:
    """What ``benchmarks/run.py`` does to ``model`` before timing prefill: eager decode
    forwards over its decode cache (the geometry and that table are learnt), then a new
    cache sized as ``run_prefill`` sizes it and every case's batch alive in it; returns
    ``{(tokens, requests): batch}``."""
    run = _run_py()
    session, batch, expected = staggered_decode_case(model, 2, seed=11)
    torch.testing.assert_close(eager_logits_fn(model)(batch), expected, **TOL)
    session.close()
    cases = [(t, r) for r in counts for t in tokens]
    lengths = {case: run.prefill_lengths(*case) for case in cases}
    model.create_kv_cache(
        num_slots=sum(tokens) * len(counts) + 1,
        max_reqs=sum(len(x) for x in lengths.values()) + 1,
        max_context_len=max(max(x) for x in lengths.values()) + 1,
    )
    return {
        case: make_extend_batch(model.kv_cache, make_dummy_prompts(len(n), n, model.config.vocab_size, seed=case[0]))
        for case, n in lengths.items()
    }


def _run_py() -> Any:
    import importlib
    import os
    import sys

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module("run")


def test_hooks_after_a_new_kv_cache_plan_over_its_table(fake):
    """A hook runs before the forward's layers pass the table: it must index the model's
    current cache, not the one of the last forward (narrower here: out of range)."""
    model = fi_model()
    backend = model.attn_backend
    assert isinstance(backend, fia.FlashInferAttention)
    with torch.no_grad():
        batches = _prefill_section_after_decode(model, [CONTEXT + 16], [1, 2])
        twin = torch_twin(model)
        for case, batch in batches.items():
            start = len(backend.plan_log)
            torch.testing.assert_close(
                eager_logits_fn(model)(batch), eager_logits_fn(twin)(batch), **TOL, msg=str(case)
            )
            assert [k for k, _, _ in list(backend.plan_log)[start:]] == ["eager"], case  # the hook's plan served
        assert backend.req_to_token is model.kv_cache.req_to_token  # told at create_kv_cache
        other = model.kv_cache
        model.create_kv_cache(num_slots=4 * CONTEXT + 1, max_reqs=5, max_context_len=CONTEXT)
        model.kv_cache = other  # a plain assignment tells the backend too
        assert backend.req_to_token is other.req_to_token
        del model.kv_cache
        assert model.kv_cache is None and backend.req_to_token is None
        model.kv_cache = other
        torch.testing.assert_close(eager_logits_fn(model)(batch), eager_logits_fn(twin)(batch), **TOL)


def test_run_py_prefill_section_after_its_decode_section_equals_torch(fake):
    """``benchmarks/run.py --attention flashinfer``'s prefill section on the CPU: eager and
    breakable prefill over tokens x requests, all batches alive in the cache made after the
    decode section's (on an H200: the capture hook's plan of the largest size indexed the
    decode cache's table, a device-side index assert)."""
    model = fi_model()
    with torch.no_grad():
        batches = _prefill_section_after_decode(model, [16, 64], [1, 4])
        twin = torch_twin(model)
        wants = {case: eager_logits_fn(twin)(batch) for case, batch in batches.items()}
        runner = _breakable_prefill(model, alias_args=False, sizes=(16, 64))
        runner.capture()
        for _ in range(2):  # rounds: every batch re-run, rewriting its own slots only
            for case, batch in batches.items():
                want = wants[case]
                torch.testing.assert_close(eager_logits_fn(model)(batch), want, **TOL, msg=f"eager {case}")
                torch.testing.assert_close(runner.forward(batch), want, **TOL, msg=f"breakable {case}")
        assert sum(runner.stats.replays_by_size.values()) == 2 * len(batches)  # every forward a replay
        runner.cleanup()


def test_the_fake_catches_what_the_kernels_would_index_out_of_range(fake):
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    prefill = fia._flashinfer().BatchPrefillWithPagedKVCacheWrapper(None)
    plan = dict(causal=True, sm_scale=1.0, window_left=-1, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                non_blocking=True)  # fmt: skip
    ones = i32([1, 1])
    with pytest.raises(OutOfRange, match=r"paged_kv_indptr \[0, 3, 2\] must start at 0 and never decrease"):
        prefill.plan(i32([0, 1, 2]), i32([0, 3, 2]), i32([1, 2, 3]), ones, 1, 1, 64, 1, **plan)
    with pytest.raises(OutOfRange, match="paged_kv_indptr ends at 4, past the 3 entries"):
        prefill.plan(i32([0, 1, 2]), i32([0, 2, 4]), i32([1, 2, 3]), ones, 1, 1, 64, 1, **plan)
    with pytest.raises(OutOfRange, match="request 1: 3 query tokens over 1 KV tokens"):
        prefill.plan(i32([0, 1, 4]), i32([0, 2, 3]), i32([1, 2, 3]), ones, 1, 1, 64, 1, **plan)
    fake.stream.complete(fake.stream.enqueued)
    prefill.plan(i32([0, 1, 2]), i32([0, 2, 3]), i32([1, 2, 9]), ones, 1, 1, 64, 1, **plan)  # slot 9 of 8
    kv = torch.zeros(8, 1, 1, 64, dtype=torch.bfloat16)
    q = torch.zeros(2, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="prefill run: a page id outside the KV cache's 8 slots"):
        prefill.run(q, (kv, kv), out=torch.empty_like(q))


def test_page_ids_are_each_requests_row_prefix_in_order():
    table = torch.arange(5 * 6, dtype=torch.int64).view(5, 6) + 100
    rows = torch.tensor([3, 1, 4, 0])
    lens = [2, 0, 6, 1]  # an empty request included
    out = torch.full((16,), -1, dtype=torch.int32)
    assert fia.write_page_ids(out, table, rows, lens) == 9
    want = [int(table[r, c]) for r, n in zip(rows.tolist(), lens) for c in range(n)]
    assert out[:9].tolist() == want and out[9:].eq(-1).all()
    with pytest.raises(ValueError, match="page-id buffer of 16 entries cannot hold 18 page ids"):
        fia.write_page_ids(out, table, rows[:3], [6, 6, 6])
    with pytest.raises(ValueError, match=r"request 1 has 7 KV tokens, more than the 6 columns of the req_to_token"):
        fia.write_page_ids(out, table, rows[:2], [2, 7])  # never an index past the row (a device assert on CUDA)


def test_prefill_full_is_refused_as_flashinfer_replans_decode_graphs_only(fake):
    """A whole-forward prefill graph would replay the capture's extend plan (on an H200 a
    device-side index assert): refused at construction, naming the attention."""
    from cuda_graph_runner.config import CudaGraphConfigError
    from cuda_graph_runner.testing.fakes import FakeGraphDeviceModule

    model = fi_model()
    assert model.replans_prefill_graphs is False and fia.FlashInferAttention.replans_prefill_graphs is False
    dm = FakeGraphDeviceModule()
    backend = FullCudaGraphBackend("cpu", phase="prefill", device_module=dm, memory_pool=dm.pool_handle)
    with pytest.raises(CudaGraphConfigError) as info:
        PrefillCudaGraphRunner(model, {"prefill": {"bs": [16]}}, device="cpu", backend=backend)
    assert "attention 'flashinfer'" in str(info.value) and "breakable" in str(info.value)


def test_compiled_full_with_compile_sizes_compiles_no_flashinfer_op_body(fake):
    """Compiled full compiles a marked op's body at each compile size; FlashInfer's body
    calls TVM-FFI functions Dynamo cannot trace (on an H200: ``ffi.Function does not support
    ToJSONGraph``), so the body is left eager."""
    from cuda_graph_runner.testing.fakes import CountingCompiler, FakeGraphDeviceModule

    model = fi_model()
    backend = FullCudaGraphBackend(
        "cpu",
        phase="decode",
        device_module=FakeGraphDeviceModule(),
        memory_pool="pool",
        compiler=CountingCompiler(),
        compile_sizes=[2],
    )
    runner = DecodeCudaGraphRunner(model, {"decode": {"bs": [1, 2, 4]}}, device="cpu", backend=backend)
    runner.show_progress = False
    with torch.no_grad():
        runner.capture()
    assert backend.compiled_forward.op_body_graphs == 0
    runner.cleanup()
