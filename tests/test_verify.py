"""Verify mode (cuda_graph_runner.runner.verify) on the CPU with emulated graphs that really replay.

The host-branch model captured with the guard off replays its capture-time branch:
verify mode catches it on the first replay whose live lengths flip the branch, even when
the first replays do not (``verify_every``). The reference model passes verify mode on
every backend that runs here. Also: the switches (config keys, environment), sampling,
the error's contents, and the idempotence of the reference model's step.
"""

from __future__ import annotations

import pytest
import torch
from host_branch_model import THRESHOLD, make_model

from cuda_graph_runner.backend import default_verify_tolerance
from cuda_graph_runner.backend.context import forward_context
from cuda_graph_runner.backend.errors import CudaGraphVerifyError
from cuda_graph_runner.config import CudaGraphConfig, CudaGraphConfigError
from cuda_graph_runner.reference.batches import GreedySession, make_decode_batch, make_dummy_prompts, make_extend_batch
from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM
from cuda_graph_runner.reference.speculative import make_draft_batch
from cuda_graph_runner.runner import DecodeCudaGraphRunner, GreedyDecodeCudaGraphRunner, PrefillCudaGraphRunner
from cuda_graph_runner.runner.draft import DraftDecodeCudaGraphRunner
from cuda_graph_runner.runner.verify import VerifyPolicy, compare_outputs, policy_from
from cuda_graph_runner.testing.fakes import RecordingBackend
from cuda_graph_runner.testing.toy_model import ToyModel, decode_batch
from cuda_graph_runner_breakable.backend import BreakableCudaGraphBackend
from cuda_graph_runner_breakable.emulation import EmulatedGraphDeviceModule
from cuda_graph_runner_full.backend import FullCudaGraphBackend

VERIFY_ENV = ("CUDA_GRAPH_RUNNER_VERIFY", "CUDA_GRAPH_RUNNER_VERIFY_FIRST_N", "CUDA_GRAPH_RUNNER_VERIFY_EVERY")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in VERIFY_ENV:
        monkeypatch.delenv(name, raising=False)


def full(phase="decode"):
    return FullCudaGraphBackend("cpu", phase=phase, device_module=EmulatedGraphDeviceModule(), memory_pool="pool-0")


def breakable(phase="decode"):
    return BreakableCudaGraphBackend(
        "cpu", phase=phase, device_module=EmulatedGraphDeviceModule(), memory_pool="pool-0"
    )


def decode_runner(model, backend, **phase):
    return DecodeCudaGraphRunner(
        model, {"decode": {"bs": [1, 2, 4], **phase}}, device="cpu", backend=backend, show_progress=False
    )


def run_session(model, runner, prompt_len, steps):
    """Prefill eagerly, then ``steps`` decode steps through ``runner`` (2 requests: one key)."""
    session = GreedySession(model, model.kv_cache, decode_fn=runner.forward)
    try:
        with torch.no_grad():
            session.prefill(make_dummy_prompts(2, prompt_len, model.config.vocab_size, seed=7))
            lens = []
            for _ in range(steps):
                lens.append(max(model.kv_cache.request_len(r) for r in session.rows) + 1)
                session.decode()
        return lens
    finally:
        session.close()


# -- the host-branch model, guard off -----------------------------------------------------------


@pytest.mark.parametrize("make_backend", [full, breakable])
def test_without_verify_the_frozen_branch_replays_wrong_silently(make_backend):
    model = make_model()
    runner = decode_runner(model, make_backend(), host_value_guard=False)
    with torch.no_grad():
        runner.capture()
        session = GreedySession(model, model.kv_cache)
        session.prefill(make_dummy_prompts(2, THRESHOLD + 2, model.config.vocab_size, seed=3))
        from cuda_graph_runner.reference.batches import make_decode_batch

        batch = make_decode_batch(model.kv_cache, session.rows, None, [t[-1] for t in session.tokens])
        assert max(batch.seq_lens_cpu) > THRESHOLD
        got = runner.forward(batch).clone()
        expected = runner.eager_forward(batch)
        session.close()
    torch.testing.assert_close(got * 2.0, expected, atol=1e-5, rtol=1e-4)  # the 1.0 branch was frozen


@pytest.mark.parametrize("make_backend", [full, breakable])
def test_verify_every_k_catches_the_branch_that_flips_on_a_later_batch(make_backend):
    model = make_model()
    backend = make_backend()
    runner = decode_runner(model, backend, host_value_guard=False, verify=True, verify_first_n=2, verify_every=3)
    with torch.no_grad():
        runner.capture()
    # Prompts of 3 tokens: decode lengths 4, 5, 6, 7, 8, 9 -> the branch flips at replay 6,
    # after the first two (checked, pass), replay 3 (checked, passes), 4 and 5 (not checked).
    with pytest.raises(CudaGraphVerifyError) as info:
        run_session(model, runner, 3, 8)
    err = info.value
    key = runner.make_key(2)
    assert err.replay_index == 6 and err.key == key and err.phase == "decode"
    assert runner.verifier.checked == [(key, 1), (key, 2), (key, 3), (key, 6)]
    assert err.max_abs_diff > 1e-3
    text = str(err)
    label = backend.name or type(backend).__name__  # built directly: named once the registry resolved it
    assert err.backend == label
    for fragment in (
        "replay 6",
        str(key),
        "'decode'",
        repr(label),
        "max abs difference",
        "host value",
        "data-dependent control flow",
        "allocated outside the static buffers",
        "random ops",
    ):
        assert fragment in text, fragment


def test_verify_first_n_alone_misses_a_later_flip():
    """The control for every_k: the first replays alone do not see the later branch."""
    model = make_model()
    runner = decode_runner(model, full(), host_value_guard=False, verify=True, verify_first_n=2)
    with torch.no_grad():
        runner.capture()
    lens = run_session(model, runner, 3, 7)
    assert max(lens) > THRESHOLD and len(runner.verifier.checked) == 2


def test_verify_catches_the_host_branch_in_prefill_with_breakable():
    model = make_model()
    runner = PrefillCudaGraphRunner(
        model,
        {"prefill": {"bs": [16, 32], "host_value_guard": False, "verify": True}},
        device="cpu",
        backend=breakable("prefill"),
        show_progress=False,
    )
    with torch.no_grad():
        runner.capture()  # the dummy requests are 16 and 32 tokens long: the 2.0 branch is frozen
        V = model.config.vocab_size
        batch = make_extend_batch(model.kv_cache, make_dummy_prompts(3, [3, 4, 5], V, seed=2))  # 12 -> 16
        assert runner.can_run(batch) and max(batch.seq_lens_cpu) <= THRESHOLD
        with pytest.raises(CudaGraphVerifyError, match="phase 'prefill'") as info:
            runner.forward(batch)
    assert info.value.key == runner.make_key(16)


# -- the reference model passes -------------------------------------------------------------------


@pytest.mark.parametrize("make_backend", [full, breakable])
def test_reference_model_passes_verify_on_every_replay(make_backend):
    model = make_model(ReferenceLlamaForCausalLM)
    runner = decode_runner(model, make_backend(), verify=True, verify_first_n=1, verify_every=1)
    with torch.no_grad():
        runner.capture()
    run_session(model, runner, 3, 8)
    assert len(runner.verifier.checked) == 8


def test_reference_model_passes_verify_in_prefill_with_breakable():
    model = make_model(ReferenceLlamaForCausalLM)
    runner = PrefillCudaGraphRunner(
        model,
        {"prefill": {"bs": [16, 32], "verify": True, "verify_every": 1}},
        device="cpu",
        backend=breakable("prefill"),
        show_progress=False,
    )
    V = model.config.vocab_size
    with torch.no_grad():
        runner.capture()
        first = make_extend_batch(model.kv_cache, make_dummy_prompts(3, [3, 9, 5], V, seed=1))
        rows = first.req_pool_indices.tolist()
        second = make_extend_batch(model.kv_cache, make_dummy_prompts(3, [6, 2, 9], V, seed=2), rows=rows)
        for batch in (first, second):
            assert runner.can_run(batch)
            runner.forward(batch)
    assert len(runner.verifier.checked) == 2


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_reference_model_passes_verify_with_tc_piecewise(phase):
    backend_mod = pytest.importorskip("cuda_graph_runner_tc_piecewise.backend")
    model = make_model(ReferenceLlamaForCausalLM)
    backend = backend_mod.TcPiecewiseCudaGraphBackend("cpu", phase=phase)
    try:
        if phase == "decode":
            runner = decode_runner(model, backend, verify=True, verify_every=1)
            with torch.no_grad():
                runner.capture()
            run_session(model, runner, 3, 4)
            assert len(runner.verifier.checked) == 4
        else:
            runner = PrefillCudaGraphRunner(
                model, {"prefill": {"bs": [16, 32], "verify": True}}, device="cpu", backend=backend, show_progress=False
            )
            with torch.no_grad():
                runner.capture()
                batch = make_extend_batch(model.kv_cache, make_dummy_prompts(2, [7, 6], model.config.vocab_size))
                runner.forward(batch)
            assert len(runner.verifier.checked) == 1
    finally:
        backend.uninstall()


def test_reference_model_step_is_idempotent():
    """Verify mode runs a step twice: the paged KV write and the output must not change."""
    model = make_model(ReferenceLlamaForCausalLM)
    cache = model.kv_cache
    session = GreedySession(model, cache)
    with torch.no_grad():
        session.prefill(make_dummy_prompts(2, 5, model.config.vocab_size, seed=5))
        from cuda_graph_runner.reference.batches import make_decode_batch

        batch = make_decode_batch(cache, session.rows, None, [t[-1] for t in session.tokens])
        outs, caches = [], []
        for _ in range(2):
            with forward_context(batch):
                outs.append(model.compute_logits(model.forward(batch), batch))
            caches.append([k.clone() for k in cache.k_buffers] + [v.clone() for v in cache.v_buffers])
    session.close()
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(*caches))


# -- switches, sampling, comparison ---------------------------------------------------------------


def test_verify_is_off_by_default_and_costs_no_state():
    runner = decode_runner(ToyModel(), RecordingBackend("cpu", phase="decode"))
    assert runner.verifier is None


def test_config_keys_round_trip_and_are_validated():
    config = CudaGraphConfig.from_dict(
        {"decode": {"verify": True, "verify_first_n": 5, "verify_every": 100, "host_value_guard": False}}
    )
    assert config.to_dict() == {
        "decode": {"verify": True, "verify_first_n": 5, "verify_every": 100, "host_value_guard": False}
    }
    assert CudaGraphConfig.from_dict(config.to_dict()) == config
    for bad, fragment in (
        ({"verify": "yes"}, "decode.verify='yes'"),
        ({"verify_first_n": -1}, "integer >= 0"),
        ({"verify_every": True}, "not a bool"),
        ({"host_value_guard": 1}, "true or false"),
        ({"verify": True, "verify_first_n": 0}, "no replay would be checked"),
    ):
        with pytest.raises(CudaGraphConfigError, match=fragment):
            CudaGraphConfig.from_dict({"decode": bad})


def test_environment_overrides_the_config(monkeypatch):
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_VERIFY", "1")
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_VERIFY_EVERY", "7")
    runner = decode_runner(ToyModel(), RecordingBackend("cpu", phase="decode"))
    assert runner.verifier is not None and runner.verifier.policy == VerifyPolicy(first_n=3, every=7)
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_VERIFY", "off")
    assert decode_runner(ToyModel(), RecordingBackend("cpu", phase="decode"), verify=True).verifier is None
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_VERIFY", "maybe")
    with pytest.raises(ValueError, match="CUDA_GRAPH_RUNNER_VERIFY='maybe'.*accepted"):
        policy_from(CudaGraphConfig().decode)
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_VERIFY", "1")
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_VERIFY_FIRST_N", "-2")
    with pytest.raises(ValueError, match="CUDA_GRAPH_RUNNER_VERIFY_FIRST_N='-2'"):
        policy_from(CudaGraphConfig().decode)


def test_sampling_per_key():
    policy = VerifyPolicy(first_n=2, every=5)
    assert [n for n in range(1, 21) if policy.samples(n)] == [1, 2, 5, 10, 15, 20]
    runner = decode_runner(ToyModel(), RecordingBackend("cpu", phase="decode"), verify=True, verify_first_n=1)
    with torch.no_grad():
        runner.capture()
        for bs in (1, 2, 1, 2, 3):
            runner.forward(decode_batch(bs))
    assert runner.verifier.checked == [(runner.make_key(1), 1), (runner.make_key(2), 1), (runner.make_key(4), 1)]


def test_compare_outputs_structures_and_nans():
    t = torch.tensor([1.0, float("nan")])
    assert compare_outputs((t, {"a": t}), (t.clone(), {"a": t.clone()}), 0.0, 0.0)[0]
    ok, diff, where = compare_outputs([t], [torch.tensor([1.0, 2.0])], 1e-3, 0.0)
    assert not ok and diff == float("inf") and where.startswith("[0]")
    ok, diff, where = compare_outputs(torch.ones(2), torch.ones(3), 1.0, 1.0)
    assert not ok and "shape" in where
    ok, diff, _ = compare_outputs(torch.tensor([1.0]), torch.tensor([1.5]), 1e-3, 1e-3)
    assert not ok and diff == pytest.approx(0.5)


class MaskedVocabModel(ToyModel):
    """Logits with a masked vocabulary: every odd token id is -inf, the last one +inf."""

    def compute_logits(self, hidden, batch):
        logits = super().compute_logits(hidden, batch)
        logits[:, 1::2] = float("-inf")
        logits[:, -2] = float("inf")
        return logits


def test_verify_accepts_a_correct_replay_whose_logits_hold_infinities():
    runner = decode_runner(MaskedVocabModel(), RecordingBackend("cpu", phase="decode"), verify=True)
    with torch.no_grad():
        runner.capture()
        for bs in (1, 3, 4):
            got = runner.forward(decode_batch(bs))
            assert torch.isneginf(got[:, 1::2]).all() and torch.isposinf(got[:, -2]).all()
    assert len(runner.verifier.checked) == 3


def test_compare_outputs_infinities():
    inf = float("inf")
    masked = torch.tensor([-inf, 1.0, inf])
    assert compare_outputs(masked, masked.clone(), 0.0, 0.0) == (True, 0.0, "")
    # An infinity on one side only is never within tolerance (rtol * inf would admit it).
    for got, want in (([-inf, 1.0, inf], [-inf, 1.0, 3.0]), ([-inf, 1.0, 3.0], [-inf, 1.0, inf])):
        ok, diff, where = compare_outputs(torch.tensor(got), torch.tensor(want), 1e-3, 1e-3)
        assert not ok and diff == inf and where.startswith("output")
    ok, diff, _ = compare_outputs(torch.tensor([inf]), torch.tensor([-inf]), 1.0, 1.0)
    assert not ok and diff == inf


class BatchMeanModel(ToyModel):
    """Breaks the model contract: every row is centred on the mean over the batch's rows."""

    def forward(self, batch):
        hidden = super().forward(batch)
        return hidden - hidden.mean(dim=0, keepdim=True)


def test_verify_names_a_batch_wide_op_among_the_causes():
    runner = decode_runner(BatchMeanModel(), RecordingBackend("cpu", phase="decode"), verify=True)
    with torch.no_grad():
        runner.capture()
        runner.forward(decode_batch(4))  # no padded row: the mean is the batch's own
        with pytest.raises(CudaGraphVerifyError) as info:
            runner.forward(decode_batch(3))  # padded to 4: the dummy row enters the mean
    assert "rows must be independent" in str(info.value) and "a mean or a norm over the batch" in str(info.value)


# -- integer outputs (token ids) are compared exactly -------------------------------------------


def test_compare_outputs_integer_leaves_exactly_whatever_the_tolerance():
    bf16_atol, bf16_rtol = default_verify_tolerance(torch.bfloat16)
    want = torch.tensor([[30000, 7], [12, 30001]])
    got = want.clone()
    got[1, 1] -= 1  # within bf16's atol + rtol * |want| of the float comparison (about 1500)
    assert 1 <= bf16_atol + bf16_rtol * 30000
    ok, diff, where = compare_outputs(got, want, bf16_atol, bf16_rtol)
    assert not ok and diff == 1.0
    assert "1 of 4 elements differ" in where and "index [1, 1]" in where and "30000 vs reference 30001" in where
    assert compare_outputs(want.clone(), want, bf16_atol, bf16_rtol) == (True, 0.0, "")
    # bool leaves and an integer leaf beside a float one: only the float one gets the tolerance.
    mask = torch.tensor([True, False, True])
    ok, _, where = compare_outputs({"m": ~mask}, {"m": mask}, 1.0, 1.0)
    assert not ok and where.startswith("['m']") and "3 of 3 elements differ" in where and "index [0]" in where
    logits = torch.tensor([1.0, 2.0])
    ok, diff, where = compare_outputs((logits + 0.01, want), (logits, want.clone()), 0.1, 0.0)
    assert ok and diff == pytest.approx(0.01) and where == ""
    ok, _, where = compare_outputs((logits + 0.01, got), (logits, want), 0.1, 0.0)
    assert not ok and where.startswith("[1]")
    # Float leaves keep the tolerance: the same difference of 1 passes a tolerance that admits it.
    assert compare_outputs(got.double(), want.double(), bf16_atol, bf16_rtol) == (True, 1.0, "")
    # An integer leaf against a float reference of equal values is exact too.
    assert compare_outputs(want, want.float(), 0.0, 0.0)[0]
    assert not compare_outputs(got, want.float(), 1e9, 1e9)[0]


class TokenShiftLlama(ReferenceLlamaForCausalLM):
    """A host-value bug that moves the greedy token by one id: the last vocabulary id
    wins when ``max(batch.seq_lens_cpu) > THRESHOLD``, the one before it otherwise (and
    when the batch carries no host lengths). A graph freezes the capture's branch."""

    def compute_logits(self, hidden, batch):
        logits = super().compute_logits(hidden, batch)
        lens = batch.seq_lens_cpu
        top = logits.shape[-1] - (1 if lens is not None and max(lens) > THRESHOLD else 2)
        logits[:, top] = 1e4
        return logits


def _token_shift_model():
    return make_model(TokenShiftLlama, dtype=torch.bfloat16)


def _prefilled(model, prompt_len):
    session = GreedySession(model, model.kv_cache)
    session.prefill(make_dummy_prompts(2, prompt_len, model.config.vocab_size, seed=5))
    return session


def test_greedy_runner_verify_fails_on_tokens_one_id_apart_and_passes_equal_tokens():
    model = _token_shift_model()
    vocab = model.config.vocab_size
    atol, rtol = FullCudaGraphBackend("cpu", phase="decode").verify_tolerance(torch.bfloat16)
    assert 1 <= atol + rtol * (vocab - 2)  # a float tolerance would let these tokens pass
    config = {"decode": {"bs": [1, 2, 4], "verify": True, "verify_first_n": 8, "host_value_guard": False}}
    runner = GreedyDecodeCudaGraphRunner(model, config, device="cpu", backend=full(), show_progress=False)
    with torch.no_grad():
        runner.capture()
        short = _prefilled(model, 3)  # decode lengths 4 <= THRESHOLD: graph and eager agree
        batch = make_decode_batch(model.kv_cache, short.rows, None, [t[-1] for t in short.tokens])
        assert runner.forward(batch).tolist() == [vocab - 2, vocab - 2]
        assert runner.verifier.checked == [(runner.make_key(2), 1)]
        short.close()
        long = _prefilled(model, THRESHOLD + 2)
        batch = make_decode_batch(model.kv_cache, long.rows, None, [t[-1] for t in long.tokens])
        assert runner.eager_forward(batch).tolist() == [vocab - 1, vocab - 1]
        with pytest.raises(CudaGraphVerifyError) as info:
            runner.forward(batch)  # the graph's frozen branch: vocab - 2
        long.close()
    text = str(info.value)
    assert info.value.max_abs_diff == 1.0 and info.value.replay_index == 2
    assert "2 of 2 elements differ" in text and "index [0]" in text and "torch.int64" in text
    assert f"{vocab - 2} vs reference {vocab - 1}" in text


def test_draft_runner_verify_fails_on_tokens_one_id_apart_and_passes_equal_tokens():
    model = _token_shift_model()
    vocab, k = model.config.vocab_size, 2
    config = {"decode": {"bs": [2], "verify": True, "verify_first_n": 8, "host_value_guard": False}}
    runner = DraftDecodeCudaGraphRunner(model, config, num_steps=k, device="cpu", backend=full(), show_progress=False)
    cache = model.kv_cache
    with torch.no_grad():
        runner.capture()
        for prompt_len, fails in ((3, False), (THRESHOLD + 2, True)):
            session = _prefilled(model, prompt_len)
            batch = make_draft_batch(cache, session.rows, [t[-1] for t in session.tokens], k)
            if not fails:
                assert runner.forward(batch).tolist() == [[vocab - 2] * k] * 2
                assert len(runner.verifier.checked) == 1
            else:
                # Step 0 reads the host lengths (eager: vocab - 1); later steps carry none.
                assert runner.eager_forward(batch).tolist() == [[vocab - 1, vocab - 2]] * 2
                with pytest.raises(CudaGraphVerifyError) as info:
                    runner.forward(batch)
            session.close()
    text = str(info.value)
    assert info.value.max_abs_diff == 1.0
    assert "2 of 4 elements differ" in text and "index [0, 0]" in text
