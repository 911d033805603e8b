"""The compile cache scope (cuda_graph_runner.compile_cache): where it puts torch.compile's
caches, that it is scoped, and the switch. The hit counts of a second start are measured
with real compiles in plugins/compiled/tests/test_compiled.py (inductor on the CPU) and
plugins/full/tests/test_full_compiled_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor.runtime.cache_dir_utils import cache_dir

from cuda_graph_runner import envs
from cuda_graph_runner.compile_cache import cache_counters, compile_cache_dir, compile_cache_scope


def test_cache_root_from_the_variable_else_xdg_else_home(tmp_path):
    assert envs.cache_root({envs.CACHE_DIR: str(tmp_path)}) == str(tmp_path)
    assert envs.cache_root({"XDG_CACHE_HOME": "/x"}) == os.path.join("/x", "cuda-graph-runner")
    assert envs.cache_root({}) == os.path.join(os.path.expanduser("~"), ".cache", "cuda-graph-runner")
    folder = compile_cache_dir({envs.CACHE_DIR: str(tmp_path)})
    assert folder == os.path.join(str(tmp_path), "compile", "torch-" + torch.__version__.replace("+", "_"))


def test_the_scope_moves_inductor_caches_only_inside_it(tmp_path, monkeypatch):
    monkeypatch.setenv(envs.CACHE_DIR, str(tmp_path))
    outside = cache_dir()
    with compile_cache_scope() as folder:
        assert folder == compile_cache_dir() and os.path.isdir(folder)
        assert cache_dir() == folder
        assert inductor_config.fx_graph_cache is True
    assert cache_dir() == outside


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
    assert set(cache_counters()) == {"fx_hit", "fx_miss", "aot_hit", "aot_miss"}
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
