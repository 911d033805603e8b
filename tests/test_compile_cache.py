"""The compile cache scope (cuda_graph_runner.backend.compile_cache): where it puts torch.compile's
caches, that it is scoped, and the switches; the key of Dynamo's cached code. The hit
counts of a second start are measured with real compiles in
plugins/compiled/tests/test_compiled.py and test_compiled_cache.py (inductor on the CPU,
a fresh process) and plugins/full/tests/test_full_compiled_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor.runtime.cache_dir_utils import cache_dir

from cuda_graph_runner.backend import compile_cache_dynamo, envs
from cuda_graph_runner.backend.compile_cache import cache_counters, compile_cache_dir, compile_cache_scope, compile_key


def test_cache_root_from_the_variable_else_xdg_else_home(tmp_path):
    assert envs.cache_root({envs.CACHE_DIR: str(tmp_path)}) == str(tmp_path)
    assert envs.cache_root({"XDG_CACHE_HOME": "/x"}) == os.path.join("/x", "cuda-graph-runner")
    assert envs.cache_root({}) == os.path.join(os.path.expanduser("~"), ".cache", "cuda-graph-runner")
    folder = compile_cache_dir({envs.CACHE_DIR: str(tmp_path)})
    assert folder == os.path.join(str(tmp_path), "compile", "torch-" + torch.__version__.replace("+", "_"))


def test_the_scope_moves_inductor_caches_only_inside_it(tmp_path, monkeypatch):
    monkeypatch.setenv(envs.CACHE_DIR, str(tmp_path))
    outside, threads_outside = cache_dir(), inductor_config.cpp.dynamic_threads
    with compile_cache_scope() as folder:
        assert folder == compile_cache_dir() and os.path.isdir(folder)
        assert cache_dir() == folder
        assert inductor_config.fx_graph_cache is True
        assert inductor_config.cpp.dynamic_threads is True  # an entry serves every thread count
    assert cache_dir() == outside and inductor_config.cpp.dynamic_threads is threads_outside


def test_the_switch_turns_it_off_and_a_bad_value_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv(envs.CACHE_DIR, str(tmp_path))
    monkeypatch.setenv(envs.COMPILE_CACHE, "0")
    outside = cache_dir()
    with compile_cache_scope() as folder:
        assert folder is None and cache_dir() == outside
    assert not (tmp_path / "compile").exists()
    monkeypatch.setenv(envs.COMPILE_CACHE, "sometimes")
    with pytest.raises(envs.EnvVarError, match="CUDA_GRAPH_RUNNER_COMPILE_CACHE='sometimes' is not a boolean"):
        with compile_cache_scope():
            pass


def test_an_unwritable_root_names_the_folder_and_the_fixes(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(envs.CACHE_DIR, str(blocker))
    with pytest.raises(
        OSError, match="CUDA_GRAPH_RUNNER_CACHE_DIR to a writable folder or CUDA_GRAPH_RUNNER_COMPILE_CACHE=0"
    ):
        with compile_cache_scope():
            pass


def test_counters_are_integers():
    assert set(cache_counters()) == {
        "fx_hit",
        "fx_miss",
        "aot_hit",
        "aot_miss",
        "dynamo_hit",
        "dynamo_miss",
        "dynamo_error",
    }
    assert all(isinstance(v, int) for v in cache_counters().values())


def test_ranks_of_a_tensor_parallel_group_get_a_folder_each(tmp_path, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv(envs.CACHE_DIR, str(tmp_path))
    alone = compile_cache_dir()
    assert os.path.basename(alone).startswith("torch-")  # no process group: no rank folder
    assert compile_cache_dir(rank=1) == os.path.join(alone, "rank_1")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    assert compile_cache_dir() == os.path.join(alone, "rank_1")


def _dynamo_state():
    import torch._dynamo.config as dynamo_config
    from torch._dynamo.package import DynamoCache

    return dynamo_config.caching_precompile, DynamoCache.path_prefix()


def test_with_a_key_dynamo_code_goes_under_the_key_only_inside(tmp_path, monkeypatch):
    assert compile_cache_dynamo.supported() is None  # this torch has the feature: the layer is tested
    monkeypatch.setenv(envs.CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(envs.COMPILE_CACHE_DYNAMO, raising=False)
    outside = _dynamo_state()
    with compile_cache_scope("k1") as folder:
        assert _dynamo_state() == (True, os.path.join(folder, "dynamo", "k1"))
    assert _dynamo_state() == outside
    unkeyed = (False, os.path.join(compile_cache_dir(), "dynamo"))  # torch's own place under the folder
    with compile_cache_scope():  # no key: the inductor caches only
        assert _dynamo_state() == unkeyed
    monkeypatch.setenv(envs.COMPILE_CACHE_DYNAMO, "0")
    with compile_cache_scope("k1"):
        assert _dynamo_state() == unkeyed


def test_a_failed_save_is_logged_and_the_block_goes_on(tmp_path, monkeypatch, caplog):
    from torch._dynamo.precompile_context import PrecompileContext

    def broken():
        raise OSError("disk full")

    monkeypatch.setenv(envs.CACHE_DIR, str(tmp_path))
    monkeypatch.setattr(PrecompileContext, "save_to_dynamo_cache", broken)
    with caplog.at_level("WARNING", logger="cuda_graph_runner.backend.compile_cache_dynamo"):
        with compile_cache_scope("k2"):
            pass
    assert "Dynamo's package not saved" in caplog.text and "disk full" in caplog.text


def test_a_torch_without_the_feature_falls_back_and_says_so(tmp_path, monkeypatch, caplog):
    import torch._dynamo.config as dynamo_config

    monkeypatch.setenv(envs.CACHE_DIR, str(tmp_path))
    monkeypatch.delattr(dynamo_config, "caching_precompile", raising=False)
    monkeypatch.setattr(compile_cache_dynamo, "_said", set())
    assert "no caching_precompile" in compile_cache_dynamo.supported()
    with caplog.at_level("INFO", logger="cuda_graph_runner.backend.compile_cache_dynamo"):
        with compile_cache_scope("k3") as folder:
            assert folder == compile_cache_dir()
    assert "Dynamo traces every start" in caplog.text


def test_the_key_follows_model_config_dtype_and_options():
    from cuda_graph_runner.reference.model import ModelConfig, ReferenceLlamaForCausalLM

    config = ModelConfig(num_hidden_layers=1)
    model = ReferenceLlamaForCausalLM.from_config(config)
    key = compile_key(model, "opts", 1)
    assert key == compile_key(ReferenceLlamaForCausalLM.from_config(config, seed=5), "opts", 1)
    assert key != compile_key(model, "opts", 2)
    assert key != compile_key(
        ReferenceLlamaForCausalLM.from_config(ModelConfig(num_hidden_layers=1, hidden_size=32)), "opts", 1
    )
    assert key != compile_key(ReferenceLlamaForCausalLM.from_config(config, dtype=torch.bfloat16), "opts", 1)
    assert key != compile_key(torch.nn.Linear(2, 2), "opts", 1)


def test_the_bench_reports_an_unwritable_cache_root_in_one_line(tmp_path, monkeypatch, capsys):
    from cuda_graph_runner.cli.command import main

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(envs.CACHE_DIR, str(blocker))
    args = "bench --device cpu --batch-sizes 1 --no-prefill --decode-backends compiled --iters 1 --steps 1"
    assert main(args.split()) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: compile cache folder") and "Traceback" not in err


class _Unpicklable:
    """Pickles as FlashInfer's TVM-FFI functions do: with a TypeError."""

    def __reduce__(self):
        raise TypeError("Type `ffi.Function` does not support ToJSONGraph")


class _HoldsAnUnpicklableObject(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.planner = _Unpicklable()
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.planner is not None  # the guards read the object
        return self.lin(x) * self.scale


def test_a_model_holding_an_unpicklable_object_compiles_and_is_not_kept(tmp_path, monkeypatch, caplog):
    # Dynamo pickles what the guards read into its package; an object that refuses with a
    # TypeError must not fail the compile: that compile is left out of the package.
    import torch._dynamo

    monkeypatch.setenv(envs.CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(envs.COMPILE_CACHE_DYNAMO, raising=False)
    torch._dynamo.reset()
    model, x = _HoldsAnUnpicklableObject(), torch.randn(2, 4)
    with caplog.at_level("INFO", logger="cuda_graph_runner.backend.compile_cache_dynamo"):
        with compile_cache_scope("k3"):
            got = torch.compile(model, backend="eager")(x)
    torch.testing.assert_close(got, model(x))
    assert "guard state cannot be saved (TypeError" in caplog.text


def test_a_guard_kind_torch_does_not_serialize_compiles_and_is_not_kept(tmp_path, monkeypatch, caplog):
    # torch raises PackageError for a guard kind it cannot serialize (MODULE_MATCH, seen on
    # the H200 under eager_first with verify), bypasses the package and then asserts on the
    # missing guard state in the same compile; the compile must go on without the package.
    import torch._dynamo
    from torch._dynamo.guards import CheckFunctionManager

    monkeypatch.setenv(envs.CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(envs.COMPILE_CACHE_DYNAMO, raising=False)
    unsupported = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    # every compile of a module with tensors has this guard kind
    monkeypatch.setattr(CheckFunctionManager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES", (*unsupported, "TENSOR_MATCH"))
    from cuda_graph_runner.backend import compile_cache_dynamo

    monkeypatch.setattr(compile_cache_dynamo, "_said", set())  # said once per process
    torch._dynamo.reset()
    model, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    with caplog.at_level("INFO", logger="cuda_graph_runner.backend.compile_cache_dynamo"):
        with compile_cache_scope("k4"):
            compiled = torch.compile(model, backend="eager", dynamic=False)
            got = compiled(x)
        torch.testing.assert_close(got, model(x))
        assert "guard state cannot be saved (PackageError: TENSOR_MATCH" in caplog.text
        # The compiled function keeps its package after the scope: a later compile (a new
        # shape, as a verify reference or an eager step at a size not compiled yet) too.
        y = torch.randn(3, 4)
        torch.testing.assert_close(compiled(y), model(y))
