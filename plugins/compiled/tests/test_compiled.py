"""Backend ``compiled`` on the CPU: the forward compiled per size bucket through the real
runners, against eager; one compile per size and none while serving; the compile budget;
the toolchain probe (the bench's choice on the CPU: tests/test_bench_resolve.py).

Most tests compile with ``aot_eager`` (Dynamo's trace and AOTAutograd, no code
generation: fractions of a second); inductor and its cache across processes:
test_compiled_cache.py (skips with the reason where the toolchain probe says inductor
cannot run).
"""

from __future__ import annotations

import logging
from typing import List

import pytest
import torch

from cuda_graph_runner.backend import ShapeKey
from cuda_graph_runner.testing.fakes import CountingCompiler
from cuda_graph_runner.testing.tolerances import model_tolerance
from cuda_graph_runner.testing.workload import (
    PRESETS,
    DecodeCudaGraphRunner,
    GreedySession,
    ModelConfig,
    ReferenceLlamaForCausalLM,
    eager_logits_fn,
    get_registry,
    greedy_generate,
    list_backends,
    make_decode_batch,
    make_dummy_prompts,
    reset_registry,
)
from cuda_graph_runner_compiled import toolchain
from cuda_graph_runner_compiled.backend import CompiledBackend

# Compiled (padded shape) against eager (live shape): the same math, summed in another order.
TOL = model_tolerance(PRESETS["tiny"], torch.float32, context_len=64)


def small_model(layers: int = 2) -> ReferenceLlamaForCausalLM:
    model = ReferenceLlamaForCausalLM.from_config(ModelConfig(num_hidden_layers=layers))
    model.create_kv_cache(num_slots=16 * 64 + 1, max_reqs=17, max_context_len=64)
    return model


def runner_for(model, sizes: List[int], **kwargs) -> DecodeCudaGraphRunner:
    kwargs.setdefault("compiler", "aot_eager")
    backend = CompiledBackend("cpu", phase="decode", **kwargs)
    return DecodeCudaGraphRunner(model, {"decode": {"bs": sizes}}, device="cpu", backend=backend, show_progress=False)


def decode_step(model, bs: int, seed: int):
    """A session of ``bs`` prompts after prefill and one decode step, and its next decode batch."""
    session = GreedySession(model, model.kv_cache)
    session.prefill(make_dummy_prompts(bs, [3 + i % 4 for i in range(bs)], model.config.vocab_size, seed=seed))
    session.decode()
    return session, make_decode_batch(model.kv_cache, session.rows, None, [t[-1] for t in session.tokens])


@pytest.fixture(scope="module")
def captured():
    model = small_model()
    compiler = CountingCompiler()
    runner = runner_for(model, [1, 2, 4], compiler=compiler)
    with torch.no_grad():
        runner.capture()
    return model, runner, compiler


def test_decode_equals_eager_on_and_off_the_buckets(captured):
    model, runner, _ = captured
    for bs in (1, 2, 3, 4, 5):
        with torch.no_grad():
            session, batch = decode_step(model, bs, seed=bs)
            expected = eager_logits_fn(model)(batch).clone()
            got = runner.forward(batch)
        assert runner.can_run(batch) == (bs <= 4)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, **TOL, msg=f"bs {bs}")
        session.close()


def test_one_compile_per_bucket_and_none_while_serving(captured):
    model, runner, compiler = captured
    assert compiler.graphs == 3  # one per size, made at capture
    assert runner.backend.captured_keys == [ShapeKey(4, "decode"), ShapeKey(2, "decode"), ShapeKey(1, "decode")]
    with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
        for bs in (1, 3, 4, 2):
            session, batch = decode_step(model, bs, seed=10 + bs)
            runner.forward(batch)
            session.close()
    assert compiler.graphs == 3
    assert runner.backend.compile_seconds > 0


def test_greedy_tokens_match_eager(captured):
    model, runner, _ = captured
    prompts = make_dummy_prompts(3, [4, 6, 9], model.config.vocab_size, seed=3)
    with torch.no_grad():
        expected = greedy_generate(model, model.kv_cache, prompts, 6)
        got = greedy_generate(model, model.kv_cache, prompts, 6, decode_fn=lambda b: runner.forward(b).clone())
    assert got == expected


def test_eager_forward_is_the_model_own_outside_calls(captured):
    model, _, _ = captured
    # The compiled forward is in place only during the backend's calls.
    assert "forward" not in model.__dict__
    assert model.forward.__func__ is type(model).forward


class DispatchRecordingCompiler:
    """A Dynamo backend whose compiled graphs record, per call, whether the autograd and
    ADInplaceOrView dispatch keys are excluded (what the opaque custom ops then skip)."""

    def __init__(self) -> None:
        self.below: List[bool] = []

    def __call__(self, gm, example_inputs):
        def run(*args):
            keys = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView)
            self.below.append(all(torch._C._dispatch_tls_is_dispatch_key_excluded(k) for k in keys))
            return gm.forward(*args)

        return run


def test_replay_dispatches_below_autograd_and_its_output_is_an_ordinary_tensor():
    model = small_model(layers=1)
    compiler = DispatchRecordingCompiler()
    runner = runner_for(model, [2], compiler=compiler)
    with torch.no_grad():
        runner.capture()
    compiler.below.clear()
    prompts = make_dummy_prompts(2, [4, 7], model.config.vocab_size, seed=5)
    with torch.no_grad():
        expected = greedy_generate(model, model.kv_cache, prompts, 4)  # KV writes of the replays land
        got = greedy_generate(model, model.kv_cache, prompts, 4, decode_fn=lambda b: runner.forward(b).clone())
        session, batch = decode_step(model, 2, seed=6)
        out = runner.forward(batch)
    session.close()
    assert got == expected
    assert compiler.below and all(compiler.below), compiler.below
    # Only for the replay: the caller's dispatch state is its own again.
    assert not torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.ADInplaceOrView)
    # Not an inference tensor (InferenceMode's would refuse this in-place write outside it).
    assert not out.is_inference() and not out.requires_grad
    out.mul_(0.5)
    # With grad on (not through the runner, which always turns it off) the autograd keys
    # stay: nothing is silently cut out of a graph autograd would record.
    from cuda_graph_runner_compiled.backend import _below_autograd

    key = torch._C.DispatchKey.ADInplaceOrView
    with torch.enable_grad(), _below_autograd():
        assert not torch._C._dispatch_tls_is_dispatch_key_excluded(key)
    with torch.no_grad(), _below_autograd():
        assert torch._C._dispatch_tls_is_dispatch_key_excluded(key)


def test_compile_budget_leaves_the_rest_eager(caplog):
    model = small_model(layers=1)
    runner = runner_for(model, [1, 2], compile_budget_s=0)
    with torch.no_grad(), caplog.at_level(logging.WARNING):
        runner.capture()
        session, batch = decode_step(model, 1, seed=1)
        expected = eager_logits_fn(model)(batch).clone()
        got = runner.forward(batch)
    session.close()
    assert runner.backend.captured_keys == []
    assert [k.size for k in runner.backend.skipped_keys] == [2, 1]
    assert not runner.can_run(batch)
    torch.testing.assert_close(got, expected)
    assert "compile budget of 0 s spent" in caplog.text and "size 1 stays uncompiled" in caplog.text


def test_discard_forgets_one_key_so_it_compiles_again():
    model = small_model(layers=1)
    compiler = CountingCompiler()
    runner = runner_for(model, [1, 2], compiler=compiler)
    with torch.no_grad():
        runner.capture()
    key = ShapeKey(2, "decode")
    runner.backend.discard(key)
    assert runner.backend.captured_keys == [ShapeKey(1, "decode")]
    runner.backend.discard(key)  # nothing left: no error
    runner.captured_keys.remove(key)
    with torch.no_grad():
        runner.capture()
    assert sorted(k.size for k in runner.backend.captured_keys) == [1, 2] and compiler.graphs == 3


def test_bad_arguments_name_the_value_and_what_is_accepted(monkeypatch):
    with pytest.raises(ValueError, match=r"unknown compiler 'tvm'; accepted: inductor, aot_eager, eager"):
        CompiledBackend("cpu", compiler="tvm")
    with pytest.raises(ValueError, match=r"compile_budget_s=-1 must be >= 0"):
        CompiledBackend("cpu", compiler="eager", compile_budget_s=-1)
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_COMPILED_COMPILER", "aot_eager")
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_COMPILED_BUDGET_S", "7")
    backend = CompiledBackend("cpu")
    assert (backend.compiler, backend.compile_budget_s) == ("aot_eager", 7.0)
    with pytest.raises(KeyError, match="no compiled forward"):
        backend.replay(ShapeKey(1, "decode"), None)
    with pytest.raises(RuntimeError, match=r"prepare\(runner\) must run"):
        backend.capture_one(ShapeKey(1, "decode"), lambda: None)


# ----------------------------------------------------------------------------- probe and registry
def test_probe_names_what_is_missing(monkeypatch):
    assert "CPU only" in toolchain.probe("cuda")
    monkeypatch.setattr(toolchain, "find_cxx", lambda: None)
    toolchain.toolchain_problem.cache_clear()
    try:
        assert toolchain.probe("cpu") == (
            "inductor needs a C++ compiler: none found ($CXX, g++, clang++, c++); e.g. apt-get install g++"
        )
        monkeypatch.setattr(toolchain, "find_cxx", lambda: "/bin/false")
        toolchain.toolchain_problem.cache_clear()
        assert toolchain.probe("cpu") == (
            "inductor's C++ compiler /bin/false does not run: '/bin/false --version' exited with 1"
        )
    finally:
        toolchain.toolchain_problem.cache_clear()


def test_listed_on_cpu_with_its_probe_and_never_the_runner_default():
    reset_registry(keep_in_process=False)
    try:
        row = {e.name: e for e in list_backends("cpu")}["compiled"]
        assert row.ok == (toolchain.probe("cpu") is None), row.reason
        assert get_registry().default_backend("decode", "cpu") == "disabled"
    finally:
        reset_registry(keep_in_process=False)
