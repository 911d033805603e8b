"""The reference model against Hugging Face transformers, and its batch modes against each other (CPU)."""

import json
import os

import pytest
import torch

from cuda_graph_runner.backend.context import forward_context
from cuda_graph_runner.backend.forward_batch import ForwardMode
from cuda_graph_runner.reference.batches import (
    GreedySession,
    eager_logits_fn,
    greedy_generate,
    make_decode_batch,
    make_dummy_prompts,
    make_extend_batch,
    make_target_verify_batch,
    pad_decode_batch,
)
from cuda_graph_runner.reference.kv_cache import CacheFullError, PagedKVCache
from cuda_graph_runner.reference.model import PRESETS, ModelConfig, ReferenceLlamaForCausalLM
from cuda_graph_runner.testing.tolerances import model_tolerance

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

ATOL = 1e-4  # against transformers: another implementation (rope, attention), not just another order
#: Batch modes of the tiny model against each other: the same math summed in another order
#: (other batch shapes pick other kernels), so the tolerance follows dtype and reduction sizes.
TINY_TOL = model_tolerance(PRESETS["tiny"], torch.float32, context_len=48)
#: Hugging Face config keywords: the tiny preset's sizes, another MLP width and a short context.
TINY = {k: getattr(PRESETS["tiny"], k) for k in ("vocab_size", "hidden_size", "num_hidden_layers")} | dict(
    num_attention_heads=PRESETS["tiny"].num_attention_heads,
    num_key_value_heads=PRESETS["tiny"].num_key_value_heads,
    intermediate_size=96,
    max_position_embeddings=128,
)


def _hf_checkpoint(tmp_dir, kind: str, **save_kwargs):
    """Build a tiny transformers model of ``kind``, randomise every weight, save it; return (hf_model, dir)."""
    torch.manual_seed({"llama": 1, "qwen2": 2, "llama3": 3, "mistral": 4}[kind])
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**TINY, tie_word_embeddings=True, rope_theta=1e6)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**TINY, sliding_window=5)
        cls = transformers.MistralForCausalLM
    elif kind == "llama3":
        cfg = transformers.LlamaConfig(
            **TINY,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.LlamaConfig(**TINY, attention_bias=True)
        cls = transformers.LlamaForCausalLM
    cfg._attn_implementation = "eager"
    hf = cls(cfg).eval()
    with torch.no_grad():
        # Non-trivial norms and biases so loading mistakes show in the logits.
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    path = os.path.join(str(tmp_dir), kind)
    hf.save_pretrained(path, safe_serialization=True, **save_kwargs)
    return hf, path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {kind: _hf_checkpoint(root, kind) for kind in ("llama", "qwen2", "llama3", "mistral")}


def _hf_logits(hf, seq):
    with torch.no_grad():
        return hf(input_ids=torch.tensor([seq])).logits[0].float()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama3", "mistral"])
def test_prefill_and_decode_match_transformers(checkpoints, kind):
    hf, path = checkpoints[kind]
    model = ReferenceLlamaForCausalLM.from_pretrained(path, dtype=torch.float32, device="cpu")
    cache = model.create_kv_cache(num_slots=128, max_reqs=4, max_context_len=32)
    prompts = make_dummy_prompts(3, [7, 12, 3], 256, seed=5)
    steps = 4
    continuations = make_dummy_prompts(3, steps, 256, seed=6)
    run = eager_logits_fn(model)

    batch = make_extend_batch(cache, prompts)
    rows = batch.req_pool_indices.tolist()
    got = [run(batch)]
    for k in range(steps):
        got.append(run(make_decode_batch(cache, rows, None, [c[k] for c in continuations])))

    for i, (prompt, cont) in enumerate(zip(prompts, continuations)):
        ref = _hf_logits(hf, prompt + cont)
        for k in range(steps + 1):
            pos = len(prompt) - 1 + k
            torch.testing.assert_close(got[k][i], ref[pos], atol=ATOL, rtol=0, msg=f"request {i} position {pos}")


def test_config_parsing_of_checkpoints(checkpoints):
    cfg = lambda kind: ModelConfig.from_hf_config(json.load(open(os.path.join(checkpoints[kind][1], "config.json"))))
    assert cfg("qwen2").qkv_bias and cfg("qwen2").tie_word_embeddings and not cfg("qwen2").o_bias
    assert cfg("llama").qkv_bias and cfg("llama").o_bias
    assert cfg("llama3").rope_scaling["rope_type"] == "llama3"
    assert cfg("mistral").sliding_window == 5


def test_sharded_checkpoint_loads_the_same(tmp_path, checkpoints):
    hf, single = checkpoints["llama"]
    _, sharded = _hf_checkpoint(tmp_path, "llama", max_shard_size="20KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    a = ReferenceLlamaForCausalLM.from_pretrained(single).state_dict()
    b = ReferenceLlamaForCausalLM.from_pretrained(sharded).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_llama_3_2_1b_style_config_json():
    """A transformers 4.x style config.json (rope_theta + rope_scaling) parses to the preset."""
    hf_cfg = {
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "attention_bias": False,
    }
    assert ModelConfig.from_hf_config(hf_cfg) == PRESETS["llama-3.2-1b"]


@pytest.mark.parametrize("name,params", [("llama-3.2-1b", 1_235_814_400), ("qwen2.5-0.5b", 494_032_768)])
def test_preset_parameter_counts(name, params):
    model = ReferenceLlamaForCausalLM(PRESETS[name], device="meta")
    assert sum(p.numel() for p in model.parameters()) == params


def test_missing_and_unexpected_tensors_are_named(tmp_path, checkpoints):
    _, path = checkpoints["llama"]
    tensors = safetensors_torch.load_file(os.path.join(path, "model.safetensors"))
    cfg = open(os.path.join(path, "config.json")).read()

    broken = tmp_path / "missing"
    broken.mkdir()
    (broken / "config.json").write_text(cfg)
    dropped = {k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    safetensors_torch.save_file(dropped, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors \['model\.layers\.1\.self_attn\.k_proj\.weight'\]"):
        ReferenceLlamaForCausalLM.from_pretrained(broken)

    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "config.json").write_text(cfg)
    safetensors_torch.save_file({**tensors, "model.extra.weight": torch.zeros(2)}, str(extra / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected tensors \['model\.extra\.weight'\]"):
        ReferenceLlamaForCausalLM.from_pretrained(extra)

    with pytest.raises(FileNotFoundError, match="config.json"):
        ReferenceLlamaForCausalLM.from_pretrained(tmp_path)


def test_unsupported_config_errors_name_the_value():
    with pytest.raises(ValueError, match=r"'gpt2'.*llama.*qwen2.*mistral"):
        ModelConfig.from_hf_config({"model_type": "gpt2"})
    base = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "vocab_size": 10,
    }
    with pytest.raises(ValueError, match=r"'yarn'.*default.*llama3"):
        ModelConfig.from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match=r"'gelu'"):
        ModelConfig.from_hf_config({**base, "hidden_act": "gelu"})
    with pytest.raises(KeyError, match="tiny"):
        ReferenceLlamaForCausalLM.from_preset("nope")


# --------------------------------------------------------------------- batch modes


@pytest.fixture()
def tiny():
    model = ReferenceLlamaForCausalLM.from_config(PRESETS["tiny"], dtype=torch.float32, seed=3, std=0.1)
    cache = model.create_kv_cache(num_slots=512, max_reqs=8, max_context_len=48)
    return model, cache


def test_chunked_prefill_matches_one_shot(tiny):
    model, cache = tiny
    prompts = make_dummy_prompts(3, [11, 6, 17], 256, seed=1)
    one = GreedySession(model, cache)
    full = one.prefill(prompts)
    for chunk in (4, 7):
        s = GreedySession(model, cache)
        torch.testing.assert_close(s.prefill(prompts, chunk_size=chunk), full, **TINY_TOL)
        s.close()
    one.close()
    assert greedy_generate(model, cache, prompts, 4) == greedy_generate(model, cache, prompts, 4, chunk_size=5)
    assert cache.num_free_requests == cache.max_reqs - 1
    assert cache.num_free_slots == cache.num_slots - 1


@pytest.mark.parametrize("w", [2, 3])
def test_target_verify_equals_sequential_decode(tiny, w):
    model, cache = tiny
    run = eager_logits_fn(model)
    prompts = make_dummy_prompts(2, [5, 9], 256, seed=2)
    drafts = make_dummy_prompts(2, w, 256, seed=3)
    seq_rows = make_extend_batch(cache, prompts)
    ver_rows = make_extend_batch(cache, prompts)
    torch.testing.assert_close(run(seq_rows), run(ver_rows))
    seq_rows, ver_rows = seq_rows.req_pool_indices.tolist(), ver_rows.req_pool_indices.tolist()

    sequential = [run(make_decode_batch(cache, seq_rows, None, [d[j] for d in drafts])) for j in range(w)]
    verify_batch = make_target_verify_batch(cache, ver_rows, drafts)
    assert verify_batch.forward_mode == ForwardMode.TARGET_VERIFY and verify_batch.num_tokens == 2 * w
    verified = run(verify_batch).view(2, w, -1)
    for j in range(w):
        torch.testing.assert_close(verified[:, j], sequential[j], **TINY_TOL)


@pytest.mark.parametrize("w", [1, 3])
def test_padded_decode_rows_do_not_change_real_rows(tiny, w):
    model, cache = tiny
    run = eager_logits_fn(model)
    prompts = make_dummy_prompts(3, [4, 8, 2], 256, seed=4)
    batch = make_extend_batch(cache, prompts)
    rows = batch.req_pool_indices.tolist()
    run(batch)
    toks = make_dummy_prompts(3, w, 256, seed=5)
    b = make_decode_batch(cache, rows, [4, 8, 2], toks if w > 1 else [t[0] for t in toks])
    plain = run(b)
    # Re-running writes the same K/V into the same slots, so the real rows must not change.
    padded = run(pad_decode_batch(b, 5))
    assert padded.shape == (5 * w, 256)
    assert torch.isfinite(padded).all()
    torch.testing.assert_close(padded[: 3 * w], plain, **TINY_TOL)
    assert torch.all(cache.req_to_token[0] == 0)


def test_extend_padded_tail_is_ignored(tiny):
    model, cache = tiny
    prompts = make_dummy_prompts(2, [5, 3], 256, seed=6)
    batch = make_extend_batch(cache, prompts)
    run = eager_logits_fn(model)
    plain = run(batch)
    pad = 4
    z = lambda t: torch.cat([t, torch.zeros(pad, dtype=t.dtype)])
    padded = batch.replace(
        input_ids=z(batch.input_ids), positions=z(batch.positions), out_cache_loc=z(batch.out_cache_loc)
    )
    with torch.no_grad(), forward_context(padded):
        hidden = model.forward(padded)
        logits = model.compute_logits(hidden, padded)
    assert hidden.shape[0] == batch.num_tokens + pad and torch.isfinite(hidden).all()
    torch.testing.assert_close(logits, plain, **TINY_TOL)


def test_bfloat16_greedy_runs():
    model = ReferenceLlamaForCausalLM.from_preset("tiny-qwen2", dtype=torch.bfloat16)
    cache = model.create_kv_cache(64, 4, 32)
    out = greedy_generate(model, cache, make_dummy_prompts(2, 6, 256), 3)
    assert len(out) == 2 and all(len(t) == 3 for t in out)


def test_forward_needs_cache_and_context():
    model = ReferenceLlamaForCausalLM.from_preset("tiny")
    cache = PagedKVCache(2, 2, 16, 16, 2, 8)
    batch = make_extend_batch(cache, [[1, 2]])
    with pytest.raises(RuntimeError, match="create_kv_cache"):
        model.forward(batch)
    model.attach_kv_cache(cache)
    with pytest.raises(RuntimeError, match="forward_context"):
        model.forward(batch)
    with pytest.raises(ValueError, match="does not fit"):
        model.attach_kv_cache(PagedKVCache(2, 1, 16, 16, 2, 8))


def test_kv_cache_allocators():
    cache = PagedKVCache(1, 1, 2, num_slots=5, max_reqs=3, max_context_len=3)
    assert cache.req_to_token.shape == (3, 3) and cache.k_buffers[0].shape == (5, 1, 2)
    r1, r2 = cache.alloc_request(), cache.alloc_request()
    assert (r1, r2) == (1, 2)
    with pytest.raises(CacheFullError, match=r"all 2 usable rows.*max_reqs=3"):
        cache.alloc_request()
    slots = cache.alloc_slots(3)
    assert slots.tolist() == [1, 2, 3]
    with pytest.raises(CacheFullError, match=r"asked for 2 slots, 1 free of 4 usable"):
        cache.alloc_slots(2)
    cache.assign_slots(r1, slots)
    assert cache.req_to_token[r1].tolist() == [1, 2, 3] and cache.request_len(r1) == 3
    with pytest.raises(CacheFullError, match="max_context_len=3"):
        cache.assign_slots(r1, cache.alloc_slots(1))
    cache.truncate_request(r1, 1)
    assert cache.req_to_token[r1].tolist() == [1, 0, 0] and cache.num_free_slots == 2
    cache.free_request(r1)
    assert cache.num_free_slots == 3 and cache.num_free_requests == 1
    with pytest.raises(KeyError, match="not allocated"):
        cache.free_request(r1)
    with pytest.raises(ValueError, match="slot 0"):
        cache.free_slots([0])
    assert torch.all(cache.req_to_token[0] == 0)
