"""Eager-through mode (cuda_graph_runner.runner.eager_through) on the CPU with emulated graphs.

With verify mode on, eager-through tells the two kinds of wrong replay apart: a planted
padding bug (a mean over the batch's rows, which padded rows enter) still fails, and the
message blames the padding path; a planted graph bug (a host-value branch frozen at
capture) passes, since no graph replays. Also: the switches (config key, environment),
that the replay path runs (padding, static buffers, slicing, owned outputs, variants) and
that no graph is replayed.
"""

from __future__ import annotations

import pytest
import torch
from host_branch_model import THRESHOLD, make_model

from cuda_graph_runner.backend.envs import EnvVarError
from cuda_graph_runner.backend.errors import CudaGraphVerifyError
from cuda_graph_runner.config import CudaGraphConfig, CudaGraphConfigError
from cuda_graph_runner.reference.batches import GreedySession, make_dummy_prompts
from cuda_graph_runner.runner import DecodeCudaGraphRunner
from cuda_graph_runner.testing.fakes import RecordingBackend
from cuda_graph_runner.testing.toy_model import ToyModel, decode_batch
from cuda_graph_runner_breakable.emulation import EmulatedGraphDeviceModule
from cuda_graph_runner_full.backend import FullCudaGraphBackend

ENV = ("CUDA_GRAPH_RUNNER_EAGER_THROUGH", "CUDA_GRAPH_RUNNER_VERIFY")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def full():
    return FullCudaGraphBackend("cpu", phase="decode", device_module=EmulatedGraphDeviceModule(), memory_pool="pool-0")


def runner_of(model, backend, **phase):
    return DecodeCudaGraphRunner(
        model, {"decode": {"bs": [1, 2, 4], **phase}}, device="cpu", backend=backend, show_progress=False
    )


class BatchMeanModel(ToyModel):
    """The planted padding bug: every row is centred on the mean over the batch's rows."""

    def forward(self, batch):
        hidden = super().forward(batch)
        return hidden - hidden.mean(dim=0, keepdim=True)


def replays(backend) -> int:
    return backend.device_module.names().count("replay")


# -- telling a padding bug from a graph bug --------------------------------------------------


@pytest.mark.parametrize("eager_through", [False, True])
def test_a_padding_bug_fails_verify_with_and_without_graphs(eager_through):
    backend = full()
    runner = runner_of(BatchMeanModel(), backend, verify=True, eager_through=eager_through)
    with torch.no_grad():
        runner.capture()
        runner.forward(decode_batch(4))  # no padded row: the mean is the batch's own
        with pytest.raises(CudaGraphVerifyError) as info:
            runner.forward(decode_batch(3))  # padded to 4: the dummy row enters the mean
    text = str(info.value)
    if eager_through:
        assert replays(backend) == 0
        assert "Eager-through mode is on" in text and "padding and static-buffer path is at fault" in text
        assert "an op across the batch's rows" in text
    else:
        assert replays(backend) == 2
        assert "CUDA_GRAPH_RUNNER_EAGER_THROUGH=1" in text


def run_session(model, runner, prompt_len, steps):
    session = GreedySession(model, model.kv_cache, decode_fn=runner.forward)
    try:
        with torch.no_grad():
            session.prefill(make_dummy_prompts(3, prompt_len, model.config.vocab_size, seed=7))
            for _ in range(steps):
                session.decode()
        return session.tokens
    finally:
        session.close()


def test_a_graph_bug_fails_verify_with_graphs_and_passes_eager_through():
    # The host-branch model, guard off: the graph freezes the capture's branch (short
    # dummy lengths), the live lengths flip it once they pass THRESHOLD.
    model = make_model()
    with_graphs = runner_of(model, full(), host_value_guard=False, verify=True, verify_every=1)
    with torch.no_grad():
        with_graphs.capture()
    with pytest.raises(CudaGraphVerifyError, match="CUDA_GRAPH_RUNNER_EAGER_THROUGH=1"):
        run_session(model, with_graphs, THRESHOLD, 4)
    with_graphs.cleanup()

    model = make_model()
    backend = full()
    eager_through = runner_of(model, backend, host_value_guard=False, verify=True, verify_every=1, eager_through=True)
    with torch.no_grad():
        eager_through.capture()
    tokens = run_session(model, eager_through, THRESHOLD, 4)  # 3 requests pad to 4: padding is sound
    key = eager_through.make_key(4)
    assert eager_through.verifier.checked == [(key, n) for n in range(1, 5)]
    assert eager_through.stats.replays_by_size == {3: 4} and replays(backend) == 0
    # The tokens are eager's own: the same session with no runner at all.
    eager_model = make_model()
    session = GreedySession(eager_model, eager_model.kv_cache)
    with torch.no_grad():
        session.prefill(make_dummy_prompts(3, THRESHOLD, eager_model.config.vocab_size, seed=7))
        for _ in range(4):
            session.decode()
    assert tokens == session.tokens
    session.close()


# -- the replay path runs, the graph does not -------------------------------------------------


def test_eager_through_pads_slices_and_owns_like_a_replay():
    backend = RecordingBackend("cpu", phase="decode", share_pool=True)
    runner = runner_of(ToyModel(), backend, eager_through=True, owned_outputs=True)
    with torch.no_grad():
        runner.capture()
        batch = decode_batch(3)
        out = runner.forward(batch)
        want = runner.eager_forward(batch)
    assert ("replay", runner.make_key(4)) not in backend.events  # the backend never replayed
    assert out.shape == want.shape == (3, 16)  # cut from the padded 4 rows
    torch.testing.assert_close(out, want)
    # The padded rows reached the static buffers, as in a replay.
    assert runner.buffers.view("req_pool_indices", 4).tolist()[3] == 0
    assert runner.describe()["mode"] == "eager_through"


def test_eager_through_is_off_by_default_and_switched_by_config_and_environment(monkeypatch):
    model = ToyModel()
    assert runner_of(model, RecordingBackend("cpu", phase="decode")).eager_through is False
    assert runner_of(model, RecordingBackend("cpu", phase="decode"), eager_through=True).eager_through is True
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_EAGER_THROUGH", "1")
    assert runner_of(model, RecordingBackend("cpu", phase="decode")).eager_through is True
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_EAGER_THROUGH", "off")
    assert runner_of(model, RecordingBackend("cpu", phase="decode"), eager_through=True).eager_through is False
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_EAGER_THROUGH", "maybe")
    with pytest.raises(EnvVarError, match="CUDA_GRAPH_RUNNER_EAGER_THROUGH.*'maybe'"):
        runner_of(model, RecordingBackend("cpu", phase="decode"))


def test_config_key_round_trips_and_is_checked():
    config = CudaGraphConfig.from_dict({"decode": {"eager_through": True}})
    assert config.decode.eager_through is True and config.prefill.eager_through is False
    assert CudaGraphConfig.from_dict(config.to_dict()).decode.eager_through is True
    with pytest.raises(CudaGraphConfigError, match="eager_through.*'yes'.*true or false"):
        CudaGraphConfig.from_dict({"decode": {"eager_through": "yes"}})


def test_prefill_eager_through_runs_the_padded_static_batch_with_the_live_requests():
    from cuda_graph_runner.reference.batches import make_extend_batch
    from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM
    from cuda_graph_runner.runner import PrefillCudaGraphRunner
    from cuda_graph_runner_breakable.backend import BreakableCudaGraphBackend

    model = ReferenceLlamaForCausalLM.from_preset("tiny", dtype=torch.float32, device="cpu")
    model.create_kv_cache(num_slots=512, max_reqs=8, max_context_len=64)
    backend = BreakableCudaGraphBackend(
        "cpu", phase="prefill", device_module=EmulatedGraphDeviceModule(), memory_pool="pool-0"
    )
    runner = PrefillCudaGraphRunner(
        model, {"prefill": {"bs": [16], "eager_through": True, "verify": True}}, device="cpu", backend=backend
    )
    with torch.no_grad():
        runner.capture()
        batch = make_extend_batch(model.kv_cache, make_dummy_prompts(2, [5, 6], model.config.vocab_size, seed=1))
        out = runner.forward(batch)  # 11 tokens padded to 16; verify compares with eager
    assert out.shape[0] == 2 and runner.verifier.checked == [(runner.make_key(16), 1)]
    assert backend.device_module.names().count("replay") == 0


def test_bench_says_its_graph_column_is_eager_under_eager_through(monkeypatch, capsys):
    from cuda_graph_runner.cli.command import main

    monkeypatch.setenv("CUDA_GRAPH_RUNNER_EAGER_THROUGH", "1")
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_BENCH_CPU_COMPILED", "1")  # a graph backend on the CPU
    argv = ["bench", "--device", "cpu", "--no-prefill", "--batch-sizes", "1", "--iters", "1", "--warmup", "0"]
    assert main([*argv, "--steps", "1", "--prompt-len", "2"]) == 0
    assert "decode: eager-through mode is on" in capsys.readouterr().out
