"""Hugging Face transformers causal LMs through the runners (cuda_graph_runner.reference.models.hf), on the CPU.

Per architecture (tiny random-weight configs): 5 ragged prompts admitted at different
steps into one continuous batch, prefilled and decoded through emulated graphs (full for
decode, breakable for prefill) with verify mode on and the host-value guard on, give
greedy tokens identical to transformers' own eager ``generate()`` of each prompt alone.
Also: transformers' mask code returns before its host branches under the adapter's
attention name, and unsupported features are refused by name.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the HF adapter needs transformers: pip install 'cuda-graph-runner[transformers]'"
)

from cuda_graph_runner.backend.context import forward_context  # noqa: E402
from cuda_graph_runner.reference.batches import make_extend_batch  # noqa: E402
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
from cuda_graph_runner_breakable.backend import BreakableCudaGraphBackend  # noqa: E402
from cuda_graph_runner_breakable.emulation import EmulatedGraphDeviceModule  # noqa: E402
from cuda_graph_runner_full.backend import FullCudaGraphBackend  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: a tiny model's kernels are far smaller than a thread pool's
    hand-off, which costs ten times the work on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


QWEN2_LAYER_WINDOWS = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}


@pytest.mark.parametrize(
    ("arch", "attention", "overrides"),
    [(arch, "torch", {}) for arch in hf.SUPPORTED_ARCHITECTURES]
    + [("llama", "planned_standin", {}), ("qwen2", "torch", QWEN2_LAYER_WINDOWS)],
    ids=[*hf.SUPPORTED_ARCHITECTURES, "llama-planned_standin", "qwen2-layer_windows"],
)
def test_continuous_batch_through_graphs_matches_hf_generate(arch, attention, overrides):
    """``planned_standin``: a plan-based attention backend (it fails any forward that runs
    unplanned or with a stale plan) gets the runner's metadata hooks through the adapter.
    ``qwen2-layer_windows``: full attention in layer 0, a sliding window in layer 1."""
    adapter, reference = tiny_models(arch, attention=attention, **overrides)
    assert adapter.attn_backend.name == attention
    if overrides:
        assert [hf.HFCausalLM._window(layer.self_attn) for layer in adapter.hf_model.model.layers] == [0, 8]
    prompts = ragged_prompts(adapter.config.vocab_size)
    expected = [hf_generate(reference, p) for p in prompts]
    adapter.create_kv_cache(num_slots=len(prompts) * (max(PROMPT_LENS) + STEPS) + 1, max_reqs=8, max_context_len=64)
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
    assert decode.config.decode.host_value_guard and prefill.config.prefill.host_value_guard
    with torch.no_grad():
        decode.capture()
        prefill.capture()
    got = run_continuous_batch(adapter, prompts, prefill.forward, decode.forward)
    # Every step replayed a graph (no eager fallback), over several batch sizes.
    assert not decode.stats.fallbacks and not prefill.stats.fallbacks
    assert len(decode.stats.replays_by_size) >= 3 and sum(prefill.stats.replays_by_size.values()) == 4
    assert got == expected, f"{arch}: the runner's greedy tokens differ from transformers' generate()"
    if arch == "mistral" or overrides:  # the window is crossed, so the sliding mask is exercised
        assert max(PROMPT_LENS) + STEPS > adapter.config.sliding_window


def test_mask_code_returns_before_its_host_branches(monkeypatch):
    """Under the adapter's attention name transformers' mask builders (as each model's
    module calls them) return None, its host-side mask branches never run (each raises
    here), and the attention gets ``attention_mask=None``."""
    import importlib

    from transformers import masking_utils

    hf.check_mask_bypass()
    for name in ("find_packed_sequence_indices", "_ignore_causal_mask_sdpa", "sdpa_mask", "eager_mask"):
        if hasattr(masking_utils, name):

            def boom(*args, _name=name, **kwargs):
                raise AssertionError(f"transformers ran its host-side mask code {_name} under the adapter")

            monkeypatch.setattr(masking_utils, name, boom)
    built = []
    for arch in hf.SUPPORTED_ARCHITECTURES:
        modeling = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
        for builder in ("create_causal_mask", "create_sliding_window_causal_mask"):
            original = getattr(modeling, builder, None)
            if original is not None:

                def record(*args, _original=original, **kwargs):
                    mask = _original(*args, **kwargs)
                    built.append(mask)
                    return mask

                monkeypatch.setattr(modeling, builder, record)
        adapter = hf.HFCausalLM.from_config(arch)
        cache = adapter.create_kv_cache(num_slots=64, max_reqs=4, max_context_len=32)
        batch = make_extend_batch(cache, [[1, 2, 3], [4, 5]])
        with torch.no_grad(), forward_context(batch):
            hidden = adapter(batch)
        assert hidden.shape == (5, adapter.config.hidden_size)
    assert len(built) >= len(hf.SUPPORTED_ARCHITECTURES) and all(m is None for m in built), built


def test_a_built_mask_fails_loudly():
    adapter = hf.HFCausalLM.from_config("llama")
    cache = adapter.create_kv_cache(num_slots=16, max_reqs=2, max_context_len=8)
    batch = make_extend_batch(cache, [[1, 2]])
    attn = adapter.hf_model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 2, 16)
    kv = torch.zeros(1, 2, 2, 16)
    with forward_context(batch), pytest.raises(RuntimeError, match="does not return early"):
        hf.paged_attention_forward(attn, q, kv, kv, torch.zeros(1, 1, 2, 2), forward_batch=batch, paged_kv_cache=cache)


@pytest.mark.parametrize(
    ("make", "feature"),
    [
        (
            lambda: transformers.LlamaConfig(**hf.TINY_CONFIG, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
            "dynamic RoPE",
        ),
        (
            lambda: transformers.Phi3Config(
                **hf.TINY_CONFIG,
                rope_scaling={
                    "rope_type": "longrope",
                    "short_factor": [1.0] * 8,
                    "long_factor": [1.0] * 8,
                    "original_max_position_embeddings": 256,
                },
            ),
            "longrope RoPE",
        ),
        (lambda: transformers.Gemma2Config(**hf.TINY_CONFIG), "softcapping"),
        (lambda: transformers.MixtralConfig(**hf.TINY_CONFIG), "MoE"),
        (lambda: transformers.DeepseekV3Config(vocab_size=256, kv_lora_rank=16), "MLA"),
        (lambda: transformers.GptOssConfig(vocab_size=256), "attention sinks"),
        (lambda: transformers.Qwen3NextConfig(vocab_size=256), "hybrid / linear attention"),
        (lambda: transformers.GPT2Config(), "architecture 'gpt2'"),
    ],
)
def test_unsupported_features_are_refused_by_name(make, feature):
    try:
        config = make()
    except (AttributeError, TypeError, ValueError) as exc:  # a config this transformers lacks or rejects
        pytest.skip(f"transformers {transformers.__version__} cannot build this config: {exc}")
    with pytest.raises(hf.UnsupportedHFModelError, match=feature.replace("(", r"\(").replace(")", r"\)")) as info:
        hf.check_supported(config)
    assert repr(config.model_type) in str(info.value)


def test_unknown_attention_backend_and_missing_cache_are_named():
    from cuda_graph_runner.reference.model import attention_backend_names

    with pytest.raises(ValueError, match=f"accepted: {', '.join(attention_backend_names())}$"):
        hf.HFCausalLM.from_config("qwen2", attention="flash")
    adapter = hf.HFCausalLM.from_config("qwen2")
    with pytest.raises(RuntimeError, match="no KV cache"):
        adapter(None)


def test_from_pretrained_loads_a_local_folder(tmp_path):
    adapter, reference = tiny_models("qwen3", seed=3)
    reference.save_pretrained(tmp_path / "ckpt")
    loaded = hf.HFCausalLM.from_pretrained(str(tmp_path / "ckpt"))
    for (name, a), b in zip(adapter.hf_model.state_dict().items(), loaded.hf_model.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hf.HFCausalLM.from_pretrained(str(tmp_path))


def test_readme_hf_snippet_runs(capsys):
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    snippets = [s for s in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "HFCausalLM" in s]
    assert snippets, "README lost its HFCausalLM snippet"
    exec(compile(snippets[0], "README.md", "exec"), {"__name__": "readme"})
    assert len(eval(capsys.readouterr().out.strip())) == 3


def test_bench_hf_model_shows_its_match_against_hf(capsys, tmp_path):
    from cuda_graph_runner.cli.command import main

    flags = ["--device", "cpu", "--batch-sizes", "2", "--decode-backends", "disabled"]
    flags += ["--prefill-backends", "disabled", "--prefill-tokens", "12", "--prefill-requests", "2", "--iters", "1"]
    adapter, reference = tiny_models("qwen3", seed=5)
    reference.save_pretrained(tmp_path / "ckpt")
    for model in ("hf:mistral", f"hf:{tmp_path / 'ckpt'}"):
        assert main(["bench", "--model", model, "--steps", "12", "--prompt-len", "6", *flags]) == 0
        out = capsys.readouterr().out
        lines = out.splitlines()
        tables = [i for i, line in enumerate(lines) if line.startswith(("batch ", "tokens "))]
        assert len(tables) == 2, out  # decode and prefill
        for at in tables:
            assert lines[at].split()[-2:] == ["HF", "match"] and lines[at + 2].split()[-1] == "yes", out
    assert main(["bench", "--model", "hf:gpt2", *flags]) == 2
    assert "after 'hf:' give an architecture (llama, qwen2, mistral, qwen3)" in capsys.readouterr().err


def test_bench_hf_real_model_needs_its_packages(capsys, monkeypatch):
    from cuda_graph_runner.cli.command import main
    from cuda_graph_runner.reference import real_model

    def missing(name):
        raise real_model.RealModelUnavailableError(f"--model {name} needs gguf: {real_model.INSTALL_HINT}")

    monkeypatch.setattr(real_model, "check_available", missing)
    assert main(["bench", "--model", "hf:smollm2-135m", "--device", "cpu", "--no-prefill"]) == 2
    assert "needs gguf" in capsys.readouterr().err


def test_modules_with_sinks_or_host_rope_are_refused():
    """A model whose config says nothing but whose modules carry attention sinks or a
    dynamic RoPE is refused by what the modules show."""
    adapter = hf.HFCausalLM.from_config("llama")
    attn = adapter.hf_model.model.layers[1].self_attn
    attn.register_parameter("sinks", torch.nn.Parameter(torch.zeros(4)))
    with pytest.raises(hf.UnsupportedHFModelError, match=r"'llama' with attention sinks \(model.layers.1.self_attn\)"):
        hf.HFCausalLM(adapter.hf_model)
    del attn.sinks
    adapter.hf_model.model.rotary_emb.rope_type = "dynamic"
    with pytest.raises(hf.UnsupportedHFModelError, match="'llama' with dynamic RoPE"):
        hf.HFCausalLM(adapter.hf_model)


def test_the_extra_declares_the_tested_transformers_range():
    import pathlib

    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    pyproject = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    assert extras["transformers"] == [f"transformers{hf.TRANSFORMERS_RANGE}"]
    low, high = (part.lstrip("<>=") for part in hf.TRANSFORMERS_RANGE.split(","))
    version = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    assert tuple(int(x) for x in low.split(".")) <= version < (int(high),), transformers.__version__
