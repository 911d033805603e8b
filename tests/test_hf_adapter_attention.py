"""The Hugging Face adapter (cuda_graph_runner.reference.models.hf) with the kernel attention
backends inside its marked op, on the CPU, and its checkpoint-shaped built-in configs.

* ``triton``: the kernels stood in by their pure-torch model
  (:class:`~cuda_graph_runner.reference.model.paged_attention_model.TorchKernels`), so the
  backend's own code (split counts, tile tables, launchers) runs as on a device: a
  continuous batch through emulated graphs gives transformers' own ``generate()`` tokens,
  and eager logits equal the adapter's with ``torch`` attention.
* ``flashinfer``: FlashInfer's wrappers faked (tests/test_flashinfer_attention.py's fake,
  which computes from the planned buffers only): bf16 eager extend and decode, and decode
  graphs re-planned before every replay, within tolerance of the ``torch`` attention.
* ``builtin_config(arch, size=...)`` of a checkpoint shape is its reference preset exactly
  (parsed back by ``ModelConfig.from_hf_config``), RoPE base and scaling included.
"""

from __future__ import annotations

import types

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the HF adapter needs transformers: pip install 'cuda-graph-runner[transformers]'"
)

from test_flashinfer_attention import fake  # noqa: E402,F401  (the fixture)

from cuda_graph_runner.backend.context import forward_context, get_forward_batch  # noqa: E402
from cuda_graph_runner.reference.batches import make_decode_batch, make_extend_batch  # noqa: E402
from cuda_graph_runner.reference.model import paged_attention_model as pam  # noqa: E402
from cuda_graph_runner.reference.model import triton_attention  # noqa: E402
from cuda_graph_runner.reference.model.attention import AttentionCall, _decode_attention  # noqa: E402
from cuda_graph_runner.reference.model.config import PRESETS, ModelConfig  # noqa: E402
from cuda_graph_runner.reference.models import hf  # noqa: E402
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner  # noqa: E402
from cuda_graph_runner.testing.hf_cases import (  # noqa: E402
    PROMPT_LENS,
    STEPS,
    hf_generate,
    ragged_prompts,
    run_continuous_batch,
    tiny_models,
)
from cuda_graph_runner.testing.tolerances import assert_kernels_close, model_depth  # noqa: E402
from cuda_graph_runner_breakable.backend import BreakableCudaGraphBackend  # noqa: E402
from cuda_graph_runner_breakable.emulation import EmulatedGraphDeviceModule  # noqa: E402
from cuda_graph_runner_full.backend import FullCudaGraphBackend  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class CaptureSafeKernels(pam.TorchKernels):
    """The stand-in with a decode that reads only device tensors (the torch attention's
    decode on the launcher's arguments), so emulated decode graphs record and replay it;
    :class:`~.paged_attention_model.TorchKernels`' split-KV model reads the lengths on
    the host, which a replay would freeze at the capture's."""

    def decode_attention(
        self, output, q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, *,
        width, num_splits, scaling, sliding_window=0, bidirectional=False, block_n=64,
    ) -> None:  # fmt: skip
        self._count()
        live = get_forward_batch()
        batch = types.SimpleNamespace(
            num_tokens_per_req=width,
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            forward_mode=live.forward_mode,
        )
        call = AttentionCall(output, q, k_cache, v_cache, req_to_token, scaling, sliding_window, batch)
        _decode_attention(call, last_layer=True)


def _stand_in(monkeypatch, stand_in):
    monkeypatch.setattr(triton_attention, "_kernels", lambda: stand_in)
    monkeypatch.setattr(triton_attention, "triton_available", lambda: True)
    monkeypatch.setattr(triton_attention, "interpreting", lambda: True)  # CPU tensors accepted
    return stand_in


@pytest.fixture()
def kernels(monkeypatch):
    """The triton kernels' pure-torch model (split-KV decode, tiled extend): eager forwards."""
    return _stand_in(monkeypatch, pam.TorchKernels())


@pytest.fixture()
def graph_kernels(monkeypatch):
    """The stand-in whose decode emulated graphs can replay; extend as the model's."""
    return _stand_in(monkeypatch, CaptureSafeKernels())


def _runners(adapter):
    emulated = EmulatedGraphDeviceModule()
    decode = DecodeCudaGraphRunner(
        adapter,
        {"decode": {"bs": [1, 2, 4, 8], "verify": True}},
        device="cpu",
        backend=FullCudaGraphBackend("cpu", phase="decode", device_module=emulated, memory_pool="pool-0"),
        show_progress=False,
    )
    prefill = PrefillCudaGraphRunner(
        adapter,
        {"prefill": {"bs": [1, 8, 16], "verify": True}},
        device="cpu",
        backend=BreakableCudaGraphBackend("cpu", phase="prefill", device_module=emulated, memory_pool="pool-0"),
        show_progress=False,
    )
    return decode, prefill


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_triton_continuous_batch_through_graphs_matches_hf_generate(graph_kernels, arch):
    """``mistral``: the sliding window (8) is crossed, so the kernels' window bounds run."""
    adapter, reference = tiny_models(arch, attention="triton")
    assert isinstance(adapter.attn_backend, triton_attention.TritonAttention)
    prompts = ragged_prompts(adapter.config.vocab_size)
    expected = [hf_generate(reference, p) for p in prompts]
    adapter.create_kv_cache(num_slots=len(prompts) * (max(PROMPT_LENS) + STEPS) + 1, max_reqs=8, max_context_len=64)
    decode, prefill = _runners(adapter)
    with torch.no_grad():
        decode.capture()
        prefill.capture()
    before = graph_kernels.calls
    got = run_continuous_batch(adapter, prompts, prefill.forward, decode.forward)
    assert graph_kernels.calls > before, "the triton backend never reached its kernels"
    assert not decode.stats.fallbacks and not prefill.stats.fallbacks and len(decode.stats.replays_by_size) >= 3
    assert got == expected, f"{arch}: the adapter with triton attention differs from transformers' generate()"


def test_triton_eager_logits_equal_torch_attention(kernels):
    adapter, _ = tiny_models("qwen3", attention="triton")
    twin, _ = tiny_models("qwen3", attention="torch")
    prompts = ragged_prompts(adapter.config.vocab_size)
    for model in (adapter, twin):
        model.create_kv_cache(num_slots=256, max_reqs=8, max_context_len=64)
    got = []
    with torch.no_grad():
        for model in (adapter, twin):
            extend = make_extend_batch(model.kv_cache, prompts)
            with forward_context(extend):
                first = model.compute_logits(model(extend), extend)
            rows = extend.req_pool_indices.tolist()
            decode = make_decode_batch(model.kv_cache, rows, None, first.argmax(-1).tolist())
            with forward_context(decode):
                got.append((first, model.compute_logits(model(decode), decode)))
    for a, b in zip(got[0], got[1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert kernels.calls > 0


FI_OVERRIDES = {"hidden_size": 128, "head_dim": 64, "num_attention_heads": 2, "num_key_value_heads": 1}


def _fi_pair(arch: str):
    """(flashinfer adapter, torch adapter) in bf16 with the same weights; head_dim 64
    (a FlashInfer kernel size)."""
    config = hf.builtin_config(arch)
    for key, value in FI_OVERRIDES.items():
        setattr(config, key, value)
    pair = [
        hf.HFCausalLM.from_config(config, dtype=torch.bfloat16, seed=3, std=0.15, attention=name)
        for name in ("flashinfer", "torch")
    ]
    for model in pair:
        model.create_kv_cache(num_slots=512, max_reqs=8, max_context_len=64)
    return pair


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_flashinfer_eager_and_replayed_decode_within_tolerance_of_torch_attention(fake, arch):  # noqa: F811
    adapter, twin = _fi_pair(arch)
    assert adapter.init_forward_metadata is not None and adapter.init_forward_metadata_replay is not None
    depth = model_depth(adapter.config)  # FlashInfer's (faked) kernels against torch's: two kernels' rounding
    prompts = ragged_prompts(adapter.config.vocab_size)
    decode = DecodeCudaGraphRunner(
        adapter,
        {"decode": {"bs": [1, 2, 4, 8]}},
        device="cpu",
        backend=FullCudaGraphBackend("cpu", phase="decode", device_module=EmulatedGraphDeviceModule()),
        show_progress=False,
    )
    with torch.no_grad():
        decode.capture()
        sessions = []
        for model in (adapter, twin):
            extend = make_extend_batch(model.kv_cache, prompts)
            if model.init_forward_metadata is not None:
                model.init_forward_metadata(extend)
            with forward_context(extend):
                sessions.append((extend.req_pool_indices.tolist(), model.compute_logits(model(extend), extend)))
        assert_kernels_close(sessions[0][1], sessions[1][1], dtype=torch.bfloat16, depth=depth, msg=f"{arch}: EXTEND")
        tokens = sessions[1][1].argmax(-1).tolist()
        fake.log.clear()
        for step in range(12):  # crosses mistral's window of 8
            ours = decode.forward(make_decode_batch(adapter.kv_cache, sessions[0][0], None, tokens))
            batch = make_decode_batch(twin.kv_cache, sessions[1][0], None, tokens)
            with forward_context(batch):
                ref = twin.compute_logits(twin(batch), batch)
            assert_kernels_close(
                ours[: len(prompts)], ref, dtype=torch.bfloat16, depth=depth, msg=f"{arch}: decode step {step}"
            )
            tokens = ref.argmax(-1).tolist()
    assert sum(decode.stats.replays_by_size.values()) == 12 and not decode.stats.fallbacks
    assert sum(p["kind"] == "decode" and p["graph"] for p in fake.log) == 12  # one re-plan per replay


@pytest.mark.parametrize(("arch", "size"), [("llama", "llama-3.2-1b"), ("qwen2", "qwen2.5-0.5b")])
def test_checkpoint_shaped_configs_are_their_reference_presets(arch, size):
    config = hf.builtin_config(arch, size=size)
    assert ModelConfig.from_hf_config(config.to_dict()) == PRESETS[size]
    assert hf.LLAMA_3_2_1B_CONFIG["rope_parameters"]["rope_theta"] == 500000.0
    with pytest.raises(ValueError, match=r"size='llama-3-1b'; accepted: 'tiny', 'llama-3.2-1b', 'qwen2.5-0.5b'"):
        hf.builtin_config(arch, size="llama-3-1b")


def test_bench_hf_model_with_triton_attention_matches_hf(graph_kernels, capsys):
    from cuda_graph_runner.cli.command import main

    flags = ["--device", "cpu", "--batch-sizes", "2", "--decode-backends", "disabled"]
    flags += ["--prefill-backends", "disabled", "--prefill-tokens", "12", "--prefill-requests", "2", "--iters", "1"]
    flags += ["--steps", "8", "--prompt-len", "6"]
    before = graph_kernels.calls
    assert main(["bench", "--model", "hf:llama", "--attention", "triton", *flags]) == 0
    out = capsys.readouterr().out
    assert "attention triton" in out and graph_kernels.calls > before, out
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("batch "))
    assert lines[at].split()[-2:] == ["HF", "match"] and lines[at + 2].split()[-1] == "yes", out
