"""``runner.describe()`` and ``cuda-graph-runner inspect`` on the CPU.

describe(): per captured key the capture seconds and the backend's facts (emulated
``full``: node counts None, as torch cannot tell on a fake graph; emulated ``breakable``:
the segments and the marked ops between them), per runner the replays and the eager
fallbacks by reason; a backend whose describe_graph raises costs only its own facts.
inspect: the bench's flags, a table or ``--json``, and the exit codes of the other
commands. ``-v`` logs one line per captured key and one summary per runner.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from cuda_graph_runner import registry
from cuda_graph_runner.backend.hookspecs import BackendSpec
from cuda_graph_runner.cli.command import main
from cuda_graph_runner.reference.batches import make_dummy_prompts, make_extend_batch
from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner
from cuda_graph_runner.testing.fakes import FakeGraphDeviceModule, RecordingBackend
from cuda_graph_runner.testing.toy_model import ToyModel, decode_batch
from cuda_graph_runner_breakable.backend import BreakableCudaGraphBackend
from cuda_graph_runner_breakable.emulation import EmulatedGraphDeviceModule
from cuda_graph_runner_full.backend import FullCudaGraphBackend


def decode_runner(backend, model=None, **phase):
    return DecodeCudaGraphRunner(
        model or ToyModel(), {"decode": {"bs": [1, 2, 4], **phase}}, device="cpu", backend=backend, show_progress=False
    )


def test_describe_lists_each_key_with_its_facts_and_the_runs():
    backend = FullCudaGraphBackend(
        "cpu", phase="decode", device_module=EmulatedGraphDeviceModule(), memory_pool="pool-0"
    )
    runner = decode_runner(backend)
    before = runner.describe()
    assert before["graphs"] == [] and before["capture_seconds"] is None and before["mode"] == "replay"
    with torch.no_grad():
        runner.capture()
        runner.forward(decode_batch(3))
        runner.forward(decode_batch(3))
        runner.forward(decode_batch(8))  # too large: eager
    doc = runner.describe()
    json.dumps(doc)  # plain JSON
    assert doc["phase"] == "decode" and doc["capture_sizes"] == [1, 2, 4]
    assert doc["replays"] == 2 and doc["eager_fallbacks"] == {"too large": 1} and doc["eager_total"] == 1
    assert doc["capture_seconds"] > 0
    assert [g["key"] for g in doc["graphs"]] == ["4|decode", "2|decode", "1|decode"]  # capture order
    by_size = {g["size"]: g for g in doc["graphs"]}
    assert by_size[4]["replays_of_size"] == 2 and by_size[2]["replays_of_size"] == 0
    for g in doc["graphs"]:
        assert g["variant"] == "decode" and g["capture_seconds"] > 0
        assert g["nodes"] is None and g["kernels"] is None  # a fake graph: torch cannot tell
    assert sum(g["capture_seconds"] for g in doc["graphs"]) <= doc["capture_seconds"]
    runner.cleanup()
    assert runner.describe()["graphs"] == []


def test_describe_shows_a_breakable_graphs_segments_and_the_ops_between():
    model = ReferenceLlamaForCausalLM.from_preset("tiny", dtype=torch.float32, device="cpu")
    model.create_kv_cache(num_slots=512, max_reqs=8, max_context_len=64)
    backend = BreakableCudaGraphBackend(
        "cpu", phase="prefill", device_module=EmulatedGraphDeviceModule(), memory_pool="pool-0"
    )
    runner = PrefillCudaGraphRunner(
        model, {"prefill": {"bs": [16]}}, device="cpu", backend=backend, show_progress=False
    )
    with torch.no_grad():
        runner.capture()
        runner.forward(make_extend_batch(model.kv_cache, make_dummy_prompts(2, [5, 6], model.config.vocab_size)))
    (graph,) = runner.describe()["graphs"]
    layers = model.config.num_hidden_layers
    # Prefill attention breaks the graph once per layer: one more segment than ops.
    assert graph["segments"] == layers + 1 == len(graph["ops_between"]) + 1
    assert len(set(graph["ops_between"])) == 1 and "attention" in graph["ops_between"][0]
    assert graph["segment_nodes"] == [None] * (layers + 1) and graph["nodes"] is None
    assert graph["replays_of_size"] == 1


class _BrokenDescribe(RecordingBackend):
    def describe_graph(self, key):
        raise RuntimeError("vendor introspection broke")


def test_a_describe_graph_that_raises_costs_only_that_backends_facts():
    runner = decode_runner(_BrokenDescribe("cpu", phase="decode"))
    with torch.no_grad():
        runner.capture()
    graphs = runner.describe()["graphs"]
    assert len(graphs) == 3
    assert all(g["describe_error"] == "RuntimeError: vendor introspection broke" for g in graphs)
    assert all(g["capture_seconds"] is not None for g in graphs)


def test_default_describe_graph_without_a_graph_table_entry_is_empty():
    backend = RecordingBackend("cpu", phase="decode")  # keeps its own table, not graph_table
    runner = decode_runner(backend)
    with torch.no_grad():
        runner.capture()
    assert set(runner.describe()["graphs"][0]) == {"key", "size", "variant", "capture_seconds", "replays_of_size"}


def test_verbose_logs_a_line_per_capture_and_a_summary_per_runner(caplog):
    runner = decode_runner(RecordingBackend("cpu", phase="decode"))
    with caplog.at_level(logging.INFO, logger="cuda_graph_runner"), torch.no_grad():
        runner.capture()
    lines = [r.getMessage() for r in caplog.records if r.name == "cuda_graph_runner.runner.base"]
    per_key = [m for m in lines if m.startswith("captured decode graph ")]
    assert [m.split()[3] for m in per_key] == ["4|decode", "2|decode", "1|decode"]
    assert all("with recording in" in m for m in per_key)
    (summary,) = [m for m in lines if m.startswith("captured 3 decode graphs")]
    assert "3 graphs held" in summary and "graph memory unknown" in summary


# -- the inspect command --------------------------------------------------------------------------


class InspectBackend(RecordingBackend):
    host_value_guard = "outside_marked_ops"  # prefill attention reads host lengths in its marked op

    def describe_graph(self, key):
        return {"nodes": 7, "kernels": 5}


@pytest.fixture()
def inspect_backend():
    registry.register(
        BackendSpec(
            name="inspect_rec",
            backend_class=InspectBackend,
            phases=("decode", "prefill"),
            devices=("*",),
            api_version="1.2",
        )
    )
    return "inspect_rec"


BASE = ["inspect", "--model", "tiny", "--batch-sizes", "2", "--prefill-tokens", "16"]


def test_inspect_json_lists_each_runner(inspect_backend, capsys):
    code = main([*BASE, "--decode-backends", inspect_backend, "--prefill-backends", inspect_backend, "--json"])
    out = capsys.readouterr().out
    assert code == 0
    docs = json.loads(out)
    assert [(d["phase"], d["backend"]) for d in docs] == [("decode", inspect_backend), ("prefill", inspect_backend)]
    decode, prefill = docs
    assert decode["capture_sizes"] == [1, 2] and [g["key"] for g in decode["graphs"]] == ["2|decode", "1|decode"]
    assert all(g["nodes"] == 7 and g["kernels"] == 5 for d in docs for g in d["graphs"])
    assert max(prefill["capture_sizes"]) == 16 and prefill["graphs"]
    assert decode["replays"] == 0 and decode["mode"] == "replay"


def test_inspect_table_and_config_flags(inspect_backend, capsys):
    code = main(
        [*BASE, "--decode-backends", inspect_backend, "--no-prefill", "--cuda-graph-config", '{"decode": {"bs": [3]}}']
    )
    out = capsys.readouterr().out
    assert code == 0
    assert f"decode, backend {inspect_backend}: 1 graph in " in out and "prefill" not in out
    header = next(line for line in out.splitlines() if line.startswith("key"))
    assert header.split()[:4] == ["key", "capture", "s", "nodes"]
    assert any(line.split()[:1] == ["3|decode"] and " 7 " in line for line in out.splitlines())


@pytest.mark.parametrize(
    "flags,code,named",
    [
        (["--decode-backends", "no_such_backend", "--no-prefill"], 2, "no_such_backend"),
        (["--cuda-graph-config", '{"decode": {"eager_through": 3}}'], 2, "eager_through"),
        (["--device", "cuda:7"], 2, "--device"),
        (["--model", "no-such-model", "--decode-backends", "disabled", "--no-prefill"], 2, "no-such-model"),
        (["--decode-backends", "full", "--no-prefill"], 1, "full"),  # installed, not usable on the CPU
        (["--batch-sizes", "0"], 2, "0"),
    ],
)
def test_inspect_exit_codes(flags, code, named, capsys):
    try:
        got = main([*BASE, *flags])
    except SystemExit as exc:  # argparse's usage errors
        got = exc.code
    err = capsys.readouterr().err
    assert got == code, err
    assert "error:" in err and named in err and "Traceback" not in err


# -- graph templates for node counts ---------------------------------------------------------------


class _KeepableGraph:
    """Stands in for ``torch.cuda.CUDAGraph``: takes ``keep_graph``, refuses ``raw_cuda_graph``
    without it (as torch does), records ``instantiate``."""

    made = []

    def __init__(self, keep_graph=False):
        self.keep_graph = keep_graph
        self.instantiated = 0
        self.captured = False
        self.id = len(type(self).made)
        type(self).made.append(self)

    def raw_cuda_graph(self):
        if not self.keep_graph:
            raise RuntimeError("You cannot access the raw cudaGraph_t instance unless keep_graph=True")
        return 0  # no real graph: graph_node_counts gives None for a null handle

    def instantiate(self):
        self.instantiated += 1

    def replay(self):
        pass


@pytest.mark.parametrize("keep", [None, True])
def test_graph_templates_are_kept_only_when_asked(keep, monkeypatch):
    monkeypatch.delenv("CUDA_GRAPH_RUNNER_GRAPH_NODES", raising=False)
    module = FakeGraphDeviceModule()
    monkeypatch.setattr(module, "CUDAGraph", _KeepableGraph)
    backend = FullCudaGraphBackend("cpu", phase="decode", device_module=module, memory_pool="pool-0")
    backend.keep_graph_templates = keep
    _KeepableGraph.made.clear()
    runner = decode_runner(backend)
    with torch.no_grad():
        runner.capture()
    assert len(_KeepableGraph.made) == 3
    kept = bool(keep)
    assert all(g.keep_graph is kept and g.instantiated == int(kept) for g in _KeepableGraph.made)
    assert all(g["nodes"] is None for g in runner.describe()["graphs"])  # no CUDA runtime graph behind it


def test_graph_nodes_environment_variable_asks_for_templates(monkeypatch):
    backend = RecordingBackend("cpu", phase="decode")
    monkeypatch.delenv("CUDA_GRAPH_RUNNER_GRAPH_NODES", raising=False)
    assert backend.wants_graph_templates() is False
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_GRAPH_NODES", "1")
    assert backend.wants_graph_templates() is True
    backend.keep_graph_templates = False  # the attribute wins
    assert backend.wants_graph_templates() is False


class _FakeRuntime:
    """The two CUDA runtime calls graph_node_counts makes: 3 nodes, the first 2 kernels."""

    def __init__(self, status=0):
        self.status = status

    def cudaGraphGetNodes(self, graph, nodes, count):  # noqa: N802 - the runtime's name
        assert graph.value == 1234
        count._obj.value = 3
        if nodes is not None:
            for i in range(3):
                nodes[i] = i + 1
        return self.status

    def cudaGraphNodeGetType(self, node, kind):  # noqa: N802 - the runtime's name
        kind._obj.value = 0 if node.value in (1, 2) else 7  # 0: cudaGraphNodeTypeKernel
        return 0


class _RawGraph:
    def raw_cuda_graph(self):
        return 1234


def test_graph_node_counts_reads_nodes_and_kernels_from_the_runtime(monkeypatch):
    from cuda_graph_runner.backend import graph_nodes

    monkeypatch.setattr(graph_nodes, "_runtime", _FakeRuntime())
    assert graph_nodes.graph_node_counts(_RawGraph()) == {"nodes": 3, "kernels": 2}
    monkeypatch.setattr(graph_nodes, "_runtime", _FakeRuntime(status=1))  # a runtime error: unknown
    assert graph_nodes.graph_node_counts(_RawGraph()) is None
    monkeypatch.setattr(graph_nodes, "_runtime", False)  # no runtime library
    assert graph_nodes.graph_node_counts(_RawGraph()) is None
    assert graph_nodes.graph_node_counts(object()) is None  # not a CUDA graph
