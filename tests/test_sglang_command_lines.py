"""sglang's command lines mean here what they mean in sglang 0.5.14.

Each row is a command line, the sglang meaning of it (what its config resolves to and
what it captures) and where sglang says so. The sglang 0.5.14 tag itself is not in the
stored copy of sgl-project/sglang; the rows cite the closest stored versions of the same
files (the per-phase config with tc_piecewise and its legacy flags), by path, commit and
line or function:

* HOOK: ``python/sglang/srt/arg_groups/cuda_graph_hook.py`` @ 019667ad6ff5.
  ``parse_cuda_graph_config`` L37-112: ``--disable-cuda-graph`` L59-62, the per-phase off
  switches "below the explicit backend selectors so --cuda-graph-backend-* wins if both
  are given" L64-70, the per-phase flags L72-86, ``--cuda-graph-tc-compiler`` written to
  both phases, "today decode ignores it" L87-91, ``--cuda-graph-config`` highest L99-104;
  ``generate_prefill_cuda_graph_batch_sizes`` (the buckets cut at max_bs, max_bs not
  added); ``generate_decode_cuda_graph_batch_sizes`` (max_bs added off the stride).
* ARGS: ``python/sglang/srt/server_args.py`` (``ServerArgs.add_cli_args``, the deprecated
  registrations): ``--cuda-graph-max-bs``, ``--cuda-graph-bs``,
  ``--piecewise-cuda-graph-tokens``, ``--piecewise-cuda-graph-max-tokens``,
  ``--piecewise-cuda-graph-compiler`` are ``DeprecatedAliasStoreAction`` with
  ``dest`` = their replacement's; ``--enable-breakable-cuda-graph``,
  ``--disable-piecewise-cuda-graph``, ``--enforce-piecewise-cuda-graph`` are
  ``DeprecatedStoreConstAction`` with ``dest="cuda_graph_backend_prefill"``;
  ``torch_compile_max_bs`` defaults to 32, ``enable_torch_compile`` to False;
  ``_handle_gpu_memory_settings``: with ``--cuda-graph-bs-decode`` given, max_bs is
  overwritten with max(bs).
* ACTIONS: ``python/sglang/srt/arg_groups/argparse_actions.py``:
  ``DeprecatedAliasStoreAction.__call__`` stores into its own ``dest`` (shared storage:
  the flag written last wins).
* CONFIG: ``python/sglang/srt/model_executor/cuda_graph_config.py`` @ 08d6c0169a56:
  ``PhaseConfig`` L79-92 (``tc_compiler`` "only meaningful when backend == tc_piecewise"
  L85-86), ``CudaGraphConfig`` defaults L104-113, ``to_dict`` diff against the defaults
  L121-128.

The deliberate differences are in docs/sglang-compat.md; ``test_the_differences_doc``
checks that each of them is there.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path
from typing import Any, Dict, List

import pytest

from cuda_graph_runner.config import CudaGraphConfig, CudaGraphConfigError, add_cuda_graph_args, from_sglang_dict
from cuda_graph_runner.config import flags as flags_module
from cuda_graph_runner.runner.decode import default_decode_batch_sizes
from cuda_graph_runner.runner.prefill import default_prefill_token_sizes
from cuda_graph_runner.runner.sizes import get_batch_sizes_to_capture

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _fresh_deprecation_state():
    flags_module._WARNED_FLAGS.clear()
    yield
    flags_module._WARNED_FLAGS.clear()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_cuda_graph_args(parser)
    return parser


def config_of(argv: List[str]) -> CudaGraphConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the deprecated flags' FutureWarnings: tested elsewhere
        return CudaGraphConfig.from_args(_parser().parse_args(argv))


def captured(config: CudaGraphConfig, phase: str) -> List[int]:
    """The sizes a runner of ``phase`` captures for ``config`` (the runners' own rule)."""
    if phase == "decode":
        return get_batch_sizes_to_capture(config.decode, 256, default_decode_batch_sizes)
    return get_batch_sizes_to_capture(config.prefill, 4096, default_prefill_token_sizes, add_max=False)


# (id, argv, {(phase, key): sglang's value}, {phase: sglang's captured sizes} or {}, source)
ROWS: List[tuple] = [
    # -- 1. tc_compiler is tc_piecewise's compiler; decode full stays plain full
    (
        "tc-compiler-both-phases",
        ["--cuda-graph-tc-compiler", "inductor"],
        {("decode", "torch_compile"): False, ("prefill", "tc_compiler"): "inductor"},
        {},
        "HOOK L87-91; CONFIG L85-86",
    ),
    (
        "piecewise-compiler-alias",
        ["--piecewise-cuda-graph-compiler", "inductor"],
        {("decode", "torch_compile"): False, ("prefill", "tc_compiler"): "inductor"},
        {},
        "ARGS --piecewise-cuda-graph-compiler (dest cuda_graph_tc_compiler); HOOK L87-91",
    ),
    (
        "tc-compiler-in-json-on-full",
        ["--cuda-graph-config", json.dumps({"decode": {"backend": "full", "tc_compiler": "inductor"}})],
        {("decode", "backend"): "full", ("decode", "torch_compile"): False},
        {},
        "HOOK L99-104; CONFIG L85-86",
    ),
    (
        "enable-torch-compile",
        ["--enable-torch-compile"],
        {("decode", "torch_compile"): "inductor", ("decode", "torch_compile_max_bs"): None},
        {},
        "ARGS enable_torch_compile, torch_compile_max_bs = 32",
    ),
    (
        "torch-compile-max-bs",
        ["--enable-torch-compile", "--torch-compile-max-bs", "16"],
        {("decode", "torch_compile"): "inductor", ("decode", "torch_compile_max_bs"): 16},
        {},
        "ARGS torch_compile_max_bs",
    ),
    # -- 2. an alias shares its replacement's storage: the flag written last wins
    (
        "alias-after-replacement-max-bs",
        ["--cuda-graph-max-bs-decode", "16", "--cuda-graph-max-bs", "8"],
        {("decode", "max_bs"): 8},
        {"decode": [1, 2, 4, 8]},
        "ARGS --cuda-graph-max-bs dest=cuda_graph_max_bs_decode; ACTIONS DeprecatedAliasStoreAction",
    ),
    (
        "replacement-after-alias-max-bs",
        ["--cuda-graph-max-bs", "8", "--cuda-graph-max-bs-decode", "16"],
        {("decode", "max_bs"): 16},
        {"decode": [1, 2, 4, 8, 12, 16]},
        "ARGS --cuda-graph-max-bs dest=cuda_graph_max_bs_decode",
    ),
    (
        "disable-piecewise-after-backend",
        ["--cuda-graph-backend-prefill", "breakable", "--disable-piecewise-cuda-graph"],
        {("prefill", "backend"): "disabled"},
        {},
        "ARGS --disable-piecewise-cuda-graph DeprecatedStoreConstAction dest=cuda_graph_backend_prefill",
    ),
    (
        "enable-breakable-after-backend",
        ["--cuda-graph-backend-prefill", "full", "--enable-breakable-cuda-graph"],
        {("prefill", "backend"): "breakable"},
        {},
        "ARGS --enable-breakable-cuda-graph dest=cuda_graph_backend_prefill",
    ),
    (
        "two-prefill-backend-aliases",
        ["--enable-breakable-cuda-graph", "--enforce-piecewise-cuda-graph"],
        {("prefill", "backend"): "tc_piecewise"},
        {},
        "ARGS both DeprecatedStoreConstAction dest=cuda_graph_backend_prefill",
    ),
    (
        "prefill-tokens-alias-last-wins",
        ["--piecewise-cuda-graph-tokens", "64", "--cuda-graph-bs-prefill", "16", "32"],
        {("prefill", "bs"): [16, 32]},
        {"prefill": [16, 32]},
        "ARGS --piecewise-cuda-graph-tokens dest=cuda_graph_bs_prefill",
    ),
    # -- 3. an off switch is below the backend flags, aliases included
    (
        "off-switch-then-breakable-alias",
        ["--disable-cuda-graph-prefill", "--enable-breakable-cuda-graph"],
        {("prefill", "backend"): "breakable"},
        {},
        "HOOK L64-70 (sglang's spelling --disable-prefill-cuda-graph)",
    ),
    (
        "off-switch-then-backend",
        ["--disable-decode-cuda-graph", "--cuda-graph-backend-decode", "full"],
        {("decode", "backend"): "full"},
        {},
        "HOOK L64-74",
    ),
    (
        "disable-cuda-graph-then-backend",
        ["--disable-cuda-graph", "--cuda-graph-backend-decode", "full"],
        {("decode", "backend"): "full", ("prefill", "backend"): "disabled"},
        {},
        "HOOK L59-62 (lowest), L73-74",
    ),
    # -- 4. explicit bs: captured as given, max_bs becomes max(bs)
    (
        "max-bs-with-bs",
        ["--cuda-graph-max-bs", "160", "--cuda-graph-bs", "1", "2", "4", "8"],
        {("decode", "bs"): [1, 2, 4, 8]},
        {"decode": [1, 2, 4, 8]},
        "ARGS _handle_gpu_memory_settings: max_bs = max(bs)",
    ),
    (
        "max-bs-below-bs",
        ["--cuda-graph-max-bs-decode", "4", "--cuda-graph-bs-decode", "1", "2", "8"],
        {("decode", "bs"): [1, 2, 8]},
        {"decode": [1, 2, 8]},
        "ARGS _handle_gpu_memory_settings: max_bs = max(bs)",
    ),
    # -- 5. decode adds max_bs off the stride, prefill stops at the last bucket
    (
        "decode-max-bs-off-stride",
        ["--cuda-graph-max-bs-decode", "20"],
        {("decode", "max_bs"): 20},
        {"decode": [1, 2, 4, 8, 12, 16, 20]},
        "HOOK generate_decode_cuda_graph_batch_sizes",
    ),
    (
        "prefill-max-bs-off-stride",
        ["--cuda-graph-max-bs-prefill", "5000"],
        {("prefill", "max_bs"): 5000},
        {"prefill": [s for s in default_prefill_token_sizes(4608)]},
        "HOOK generate_prefill_cuda_graph_batch_sizes",
    ),
    (
        "prefill-max-tokens-alias",
        ["--piecewise-cuda-graph-max-tokens", "40"],
        {("prefill", "max_bs"): 40},
        {"prefill": [4, 8, 12, 16, 20, 24, 28, 32]},
        "ARGS --piecewise-cuda-graph-max-tokens; HOOK generate_prefill_cuda_graph_batch_sizes",
    ),
    # -- 6. sglang's per-phase off switches parse
    (
        "disable-prefill-cuda-graph",
        ["--disable-prefill-cuda-graph"],
        {("prefill", "backend"): "disabled", ("decode", "backend"): None},
        {},
        "HOOK L67-68",
    ),
    (
        "disable-decode-cuda-graph",
        ["--disable-decode-cuda-graph"],
        {("decode", "backend"): "disabled", ("prefill", "backend"): None},
        {},
        "HOOK L69-70",
    ),
    # -- 8. the last of repeated valid values wins (the invalid case: test_superseded_*)
    (
        "repeated-backend-last-wins",
        ["--cuda-graph-backend-decode", "breakable", "--cuda-graph-backend-decode", "full"],
        {("decode", "backend"): "full"},
        {},
        "argparse store (ARGS --cuda-graph-backend-decode)",
    ),
]


@pytest.mark.parametrize("argv, fields, sizes, source", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_command_line_means_what_it_means_in_sglang(argv, fields: Dict, sizes: Dict, source: str):
    config = config_of(argv)
    for (phase, key), value in fields.items():
        assert getattr(config[phase], key) == value, (argv, phase, key, source)
    for phase, expected in sizes.items():
        assert captured(config, phase) == expected, (argv, phase, source)


def test_superseded_backend_is_checked_like_the_last_one():
    """sglang checks each value a flag is given (argparse choices): the first of
    ``--cuda-graph-backend-decode npu --cuda-graph-backend-decode full`` is refused where
    npu is not a decode backend, though the last one wins."""
    config = config_of(["--cuda-graph-backend-decode", "npu", "--cuda-graph-backend-decode", "full"])
    assert config.decode.backend == "full"
    with pytest.raises(CudaGraphConfigError) as info:
        config.validate({"full": ("decode",), "breakable": ("decode", "prefill")})
    text = str(info.value)
    assert "decode.backend='npu'" in text and "a later flag replaced it" in text
    assert "flag:--cuda-graph-backend-decode" in text
    # installed and for the phase: fine, and with_phase keeps what was replaced
    config.validate({"full": ("decode",), "npu": ("decode",)})
    assert config.with_phase("decode", max_bs=8).superseded == config.superseded


def test_superseded_backend_is_checked_when_resolved():
    from cuda_graph_runner.registry import get_registry

    config = config_of(["--cuda-graph-backend-decode", "nosuch", "--cuda-graph-backend-decode", "disabled"])
    with pytest.raises(CudaGraphConfigError, match="decode.backend='nosuch'.*a later flag replaced it"):
        get_registry().resolve("decode", config, device="cpu")
    assert get_registry().resolve("prefill", config, device="cpu").name == "disabled"


def test_prefill_max_bs_below_every_bucket_is_refused_by_the_runner():
    """sglang captures no prefill graph for ``--cuda-graph-max-bs-prefill 2`` (HOOK
    generate_prefill_cuda_graph_batch_sizes is empty) and runs prefill eagerly; here a
    graph config that captures nothing is an error naming the key (a deliberate
    difference, docs/sglang-compat.md)."""
    from cuda_graph_runner.runner.prefill import PrefillCudaGraphRunner
    from cuda_graph_runner.testing.fakes import RecordingBackend
    from cuda_graph_runner.testing.toy_model import ToyModel

    config = config_of(["--cuda-graph-max-bs-prefill", "2"])
    with pytest.raises(CudaGraphConfigError) as info:
        PrefillCudaGraphRunner(ToyModel(), config, device="cpu", backend=RecordingBackend("cpu", phase="prefill"))
    text = str(info.value)
    assert "prefill.max_bs=2" in text and "smallest prefill bucket" in text
    assert "flag:--cuda-graph-max-bs-prefill" in text


def test_tc_compiler_from_sglang_flags_on_full_warns_that_it_is_ignored():
    from cuda_graph_runner.backend import options as backend_options

    config = config_of(["--cuda-graph-tc-compiler", "inductor"])
    selected = {"decode": ("full", ("torch_compile", "compile_sizes")), "prefill": ("breakable", ())}
    with pytest.warns(UserWarning, match="ignored.*--enable-torch-compile"):
        backend_options.check_config(config, selected, {"tc_compiler": ["tc_piecewise"]})
    from_json = config_of(
        ["--cuda-graph-config", json.dumps({"decode": {"backend": "full", "tc_compiler": "inductor"}})]
    )
    with pytest.warns(UserWarning, match="json:--cuda-graph-config.*ignored"):
        backend_options.check_config(from_json, selected, {"tc_compiler": ["tc_piecewise"]})
    # the same key from the API is an error naming who reads it (not silently ignored)
    api = CudaGraphConfig.from_dict({"prefill": {"backend": "breakable", "tc_compiler": "inductor"}})
    with pytest.raises(CudaGraphConfigError, match="backend 'breakable' does not read option 'tc_compiler'"):
        backend_options.check_config(api, selected, {"tc_compiler": ["tc_piecewise"]})


# -- the compiled-full migration: the old spelling, one release, with a DeprecationWarning


@pytest.mark.parametrize(
    "build",
    [
        lambda: CudaGraphConfig.from_dict({"decode": {"backend": "full", "tc_compiler": "inductor"}}),
        lambda: CudaGraphConfig.from_args(
            _parser().parse_args(["--cuda-graph-backend-decode", "full", "--cuda-graph-tc-compiler-decode", "inductor"])
        ),
        lambda: CudaGraphConfig().with_phase("decode", backend="full", tc_compiler="inductor"),
    ],
    ids=["api-dict", "per-phase-flag", "with_phase"],
)
def test_deprecated_compiled_full_spelling_warns_and_compiles(build):
    with pytest.warns(DeprecationWarning, match="use torch_compile: 'inductor'.*--enable-torch-compile"):
        config = build()
    assert config.decode.torch_compile == "inductor" and config.decode.tc_compiler == "eager"
    assert config.decode.compiled_max_bs() >= 256  # the deprecated spelling compiles every captured size


def test_deprecated_bench_label_warns_and_reads_as_its_replacement():
    from cuda_graph_runner.cli.bench.backends import TORCH_COMPILE, label_of, parse_backends

    with pytest.warns(DeprecationWarning, match="'full\\+torch_compile'"):
        parsed = parse_backends("full:inductor,tc_piecewise:inductor", None)
    assert parsed == [("full", TORCH_COMPILE), ("tc_piecewise", "inductor")]
    assert [label_of(*p) for p in parsed] == ["full+torch_compile", "tc_piecewise:inductor"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parse_backends("full+torch_compile", None) == [("full", TORCH_COMPILE)]


# -- the importer of configs saved by sglang (CONFIG L121-128: to_dict is a diff)


@pytest.mark.parametrize(
    "saved, fields",
    [
        ({"decode": {}, "prefill": {}}, {("decode", "backend"): "full", ("prefill", "backend"): "tc_piecewise"}),
        (
            {"decode": {}, "prefill": {"tc_compiler": "inductor"}},
            {("prefill", "backend"): "tc_piecewise", ("prefill", "tc_compiler"): "inductor"},
        ),
        (
            {"decode": {"tc_compiler": "inductor"}, "prefill": {"backend": "breakable", "tc_compiler": "inductor"}},
            {
                ("decode", "torch_compile"): False,
                ("decode", "tc_compiler"): "eager",
                ("prefill", "tc_compiler"): "eager",
            },
        ),
        (
            {"decode": {"max_bs": 160, "bs": [1, 2, 4, 8]}, "prefill": {"backend": "breakable", "max_bs": 2048}},
            {("decode", "bs"): [1, 2, 4, 8], ("prefill", "backend"): "breakable", ("prefill", "max_bs"): 2048},
        ),
        (
            {"prefill": {"full_prefill_max_req": 8}},  # read by sglang's prefill full only: ignored
            {("prefill", "backend"): "tc_piecewise", ("prefill", "full_prefill_max_req"): None},
        ),
        (
            {"prefill": {"backend": "full", "full_prefill_max_req": 4}},  # prefill full's request slots: kept
            {("prefill", "backend"): "full", ("prefill", "full_prefill_max_req"): 4},
        ),
    ],
)
def test_sglang_saved_config_reads_with_sglangs_defaults(saved: Dict[str, Any], fields, tmp_path):
    path = tmp_path / "sglang.json"
    path.write_text(json.dumps(saved))
    for config in (from_sglang_dict(saved), from_sglang_dict(str(path))):
        for (phase, key), value in fields.items():
            assert getattr(config[phase], key) == value, (saved, phase, key)
    assert config.source_of("decode", "backend") in ("sglang", "sglang:default")


@pytest.mark.parametrize(
    "saved, fragments",
    [
        ({"decode": {"max_batch": 8}}, ["decode.max_batch=8", "not a key sglang"]),
        ({"verify": {}}, ["unknown phase", "'verify'"]),
        (
            {"prefill": {"backend": "full", "full_prefill_prefix_chunk_tokens": 4}},
            ["prefill.full_prefill_prefix_chunk_tokens=4", "prefill backend full"],
        ),
        ([1], ["must be an object"]),
        ({"decode": {"max_bs": 0}}, ["decode.max_bs=0", "from sglang"]),
    ],
)
def test_sglang_saved_config_errors_name_the_value(saved: Any, fragments: List[str]):
    with pytest.raises(CudaGraphConfigError) as info:
        from_sglang_dict(saved)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_prefill_full_keys_on_decode_full_are_read_as_sglang_reads_them():
    # sglang's PhaseConfig carries the prefill-full keys in every phase; decode full ignores them.
    config = from_sglang_dict({"decode": {"backend": "full", "max_seq_len": 4096}, "prefill": {}})
    assert config.decode.backend == "full"


def test_breakable_prefill_default_of_later_sglang(tmp_path):
    config = from_sglang_dict({"decode": {}, "prefill": {}}, prefill_default="breakable")
    assert config.prefill.backend == "breakable"


# -- the differences doc


DIFFERENCES = (
    "--cuda-graph-tc-compiler-decode",
    "tc_piecewise for decode",
    "--cuda-graph-max-bs-prefill 2",
    "4096",
    "--enable-torch-compile",
    "tc_compiler` with a backend",
    "to_dict",
    "full_prefill_max_req",
)


def test_the_differences_doc_lists_each_deliberate_difference_and_is_linked():
    doc = (ROOT / "docs" / "sglang-compat.md").read_text(encoding="utf-8")
    for text in DIFFERENCES:
        assert text in doc, text
    assert "docs/sglang-compat.md" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_config_command_shows_max_bs_as_max_of_bs(capsys):
    """``cuda-graph-runner config --cuda-graph-max-bs 160 --cuda-graph-bs 1 2 4 8``: the
    effective max_bs is 8, what the runner captures up to (sglang's max(bs))."""
    from cuda_graph_runner.cli.command import main

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert main(["config", "--cuda-graph-max-bs", "160", "--cuda-graph-bs", "1", "2", "4", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["effective"]["decode"]["max_bs"] == 8
