"""argparse integration: flags, precedence, sources, deprecated aliases, flag errors."""

from __future__ import annotations

import argparse
import json
import re
import warnings

import pytest

from cuda_graph_runner import config as config_module
from cuda_graph_runner.config import PHASE_KEYS, CudaGraphConfig, CudaGraphConfigError, Phase, add_cuda_graph_args
from cuda_graph_runner.config import flags as flags_module


@pytest.fixture(autouse=True)
def _fresh_deprecation_state():
    """Deprecated flags warn once per process; start each test as a fresh process would."""
    flags_module._WARNED_FLAGS.clear()
    yield
    flags_module._WARNED_FLAGS.clear()


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prog")
    add_cuda_graph_args(parser)
    return parser


def parse(argv):
    """(namespace, FutureWarnings emitted) for argv."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ns = make_parser().parse_args(argv)
    return ns, [w for w in caught if issubclass(w.category, FutureWarning)]


def build(argv) -> CudaGraphConfig:
    return CudaGraphConfig.from_args(parse(argv)[0])


def j(obj) -> str:
    return json.dumps(obj)


L, F, J = "legacy:", "flag:", "json:--cuda-graph-config"

# (id, argv, expected non-default fields {(phase, key): value}, expected sources)
CASES = [
    ("nothing", [], {}, {}),
    # -- each form alone
    (
        "legacy-alone",
        ["--disable-cuda-graph"],
        {("decode", "backend"): "disabled", ("prefill", "backend"): "disabled"},
        {("decode", "backend"): L + "--disable-cuda-graph", ("prefill", "backend"): L + "--disable-cuda-graph"},
    ),
    (
        "flag-alone-backend",
        ["--cuda-graph-backend-decode", "full"],
        {("decode", "backend"): "full"},
        {("decode", "backend"): F + "--cuda-graph-backend-decode"},
    ),
    (
        "flag-alone-bs-spaces-and-commas",
        ["--cuda-graph-bs-prefill", "64,16", "32", "16"],
        {("prefill", "bs"): [16, 32, 64]},
        {("prefill", "bs"): F + "--cuda-graph-bs-prefill"},
    ),
    (
        "flag-alone-max-bs",
        ["--cuda-graph-max-bs-prefill", "2048"],
        {("prefill", "max_bs"): 2048},
        {("prefill", "max_bs"): F + "--cuda-graph-max-bs-prefill"},
    ),
    (
        "flag-alone-tc-both",
        ["--cuda-graph-tc-compiler", "inductor"],
        {("decode", "tc_compiler"): "inductor", ("prefill", "tc_compiler"): "inductor"},
        {
            ("decode", "tc_compiler"): F + "--cuda-graph-tc-compiler",
            ("prefill", "tc_compiler"): F + "--cuda-graph-tc-compiler",
        },
    ),
    (
        "flag-alone-disable-phase",
        ["--disable-cuda-graph-prefill"],
        {("prefill", "backend"): "disabled"},
        {("prefill", "backend"): "off:--disable-cuda-graph-prefill"},
    ),
    (
        "json-alone",
        ["--cuda-graph-config", j({"decode": {"backend": "breakable", "bs": [8, 1]}})],
        {("decode", "backend"): "breakable", ("decode", "bs"): [1, 8]},
        {("decode", "backend"): J, ("decode", "bs"): J},
    ),
    # -- pairs: legacy + flag
    (
        "legacy-disable+flag-decode-full",
        ["--disable-cuda-graph", "--cuda-graph-backend-decode", "full"],
        {("decode", "backend"): "full", ("prefill", "backend"): "disabled"},
        {("decode", "backend"): F + "--cuda-graph-backend-decode", ("prefill", "backend"): L + "--disable-cuda-graph"},
    ),
    (
        "flag-before-legacy-same-result",
        ["--cuda-graph-backend-decode", "full", "--disable-cuda-graph"],
        {("decode", "backend"): "full", ("prefill", "backend"): "disabled"},
        {("decode", "backend"): F + "--cuda-graph-backend-decode", ("prefill", "backend"): L + "--disable-cuda-graph"},
    ),
    (
        "legacy-max-bs+flag-max-bs",
        ["--cuda-graph-max-bs", "64", "--cuda-graph-max-bs-decode", "128"],
        {("decode", "max_bs"): 128},
        {("decode", "max_bs"): F + "--cuda-graph-max-bs-decode"},
    ),
    (
        "legacy-compiler+flag-phase-compiler",
        ["--piecewise-cuda-graph-compiler", "inductor", "--cuda-graph-tc-compiler-prefill", "eager"],
        {("decode", "tc_compiler"): "inductor"},
        {
            ("decode", "tc_compiler"): L + "--piecewise-cuda-graph-compiler",
            ("prefill", "tc_compiler"): F + "--cuda-graph-tc-compiler-prefill",
        },
    ),
    # -- pairs: legacy + JSON
    (
        "legacy-disable+json-prefill",
        ["--disable-cuda-graph", "--cuda-graph-config", j({"prefill": {"backend": "breakable"}})],
        {("decode", "backend"): "disabled", ("prefill", "backend"): "breakable"},
        {("decode", "backend"): L + "--disable-cuda-graph", ("prefill", "backend"): J},
    ),
    (
        "legacy-tokens+json-tokens",
        ["--piecewise-cuda-graph-tokens", "8", "16", "--cuda-graph-config", j({"prefill": {"bs": [4]}})],
        {("prefill", "bs"): [4]},
        {("prefill", "bs"): J},
    ),
    # -- pairs: flag + JSON
    (
        "flag+json-json-wins-per-key",
        [
            "--cuda-graph-backend-decode",
            "full",
            "--cuda-graph-max-bs-decode",
            "64",
            "--cuda-graph-config",
            j({"decode": {"backend": "breakable"}}),
        ],
        {("decode", "backend"): "breakable", ("decode", "max_bs"): 64},
        {("decode", "backend"): J, ("decode", "max_bs"): F + "--cuda-graph-max-bs-decode"},
    ),
    (
        "json-null-resets-flag-to-auto",
        ["--cuda-graph-backend-decode", "full", "--cuda-graph-config", j({"decode": {"backend": None}})],
        {},
        {("decode", "backend"): J},
    ),
    (
        "json-max-bs-covers-flag-bs",
        ["--cuda-graph-bs-decode", "1", "2", "--cuda-graph-config", j({"decode": {"max_bs": 8}})],
        {("decode", "bs"): [1, 2], ("decode", "max_bs"): 8},
        {("decode", "bs"): F + "--cuda-graph-bs-decode", ("decode", "max_bs"): J},
    ),
    # -- all three
    (
        "legacy+flag+json",
        [
            "--disable-cuda-graph",
            "--cuda-graph-backend-prefill",
            "breakable",
            "--cuda-graph-max-bs",
            "32",
            "--cuda-graph-config",
            j({"decode": {"backend": "full"}}),
        ],
        {("decode", "backend"): "full", ("prefill", "backend"): "breakable", ("decode", "max_bs"): 32},
        {
            ("decode", "backend"): J,
            ("prefill", "backend"): F + "--cuda-graph-backend-prefill",
            ("decode", "max_bs"): L + "--cuda-graph-max-bs",
        },
    ),
    # -- within one tier: one phase beats both phases, in any order
    (
        "phase-compiler-beats-both",
        ["--cuda-graph-tc-compiler", "inductor", "--cuda-graph-tc-compiler-decode", "eager"],
        {("prefill", "tc_compiler"): "inductor"},
        {
            ("decode", "tc_compiler"): F + "--cuda-graph-tc-compiler-decode",
            ("prefill", "tc_compiler"): F + "--cuda-graph-tc-compiler",
        },
    ),
    (
        "phase-compiler-beats-both-reversed",
        ["--cuda-graph-tc-compiler-decode", "eager", "--cuda-graph-tc-compiler", "inductor"],
        {("prefill", "tc_compiler"): "inductor"},
        {
            ("decode", "tc_compiler"): F + "--cuda-graph-tc-compiler-decode",
            ("prefill", "tc_compiler"): F + "--cuda-graph-tc-compiler",
        },
    ),
    (
        "legacy-breakable-beats-legacy-disable-all",
        ["--disable-cuda-graph", "--enable-breakable-cuda-graph"],
        {("decode", "backend"): "disabled", ("prefill", "backend"): "breakable"},
        {
            ("decode", "backend"): L + "--disable-cuda-graph",
            ("prefill", "backend"): L + "--enable-breakable-cuda-graph",
        },
    ),
    (
        "backend-flag-beats-off-switch",
        ["--disable-cuda-graph-decode", "--cuda-graph-backend-decode", "disabled"],
        {("decode", "backend"): "disabled"},
        {("decode", "backend"): F + "--cuda-graph-backend-decode"},
    ),
    (
        "repeated-flag-last-wins",
        ["--cuda-graph-bs-decode", "1", "--cuda-graph-bs-decode", "2"],
        {("decode", "bs"): [2]},
        {("decode", "bs"): F + "--cuda-graph-bs-decode"},
    ),
]


@pytest.mark.parametrize("argv, fields, sources", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_precedence_table(argv, fields, sources):
    config = build(argv)
    default = CudaGraphConfig()
    for phase in Phase.ALL:
        for key in PHASE_KEYS:
            expected = fields.get((phase, key), getattr(default[phase], key))
            assert getattr(config[phase], key) == expected, (phase, key)
    assert config.sources == sources
    for phase in Phase.ALL:
        for key in PHASE_KEYS:
            assert config.source_of(phase, key) == sources.get((phase, key), "default")


def test_json_path_and_sources(tmp_path):
    f = tmp_path / "cg.json"
    f.write_text(j({"prefill": {"backend": "breakable", "max_bs": 1024}}))
    config = build(["--cuda-graph-max-bs-prefill", "512", "--cuda-graph-config", str(f)])
    assert (config.prefill.backend, config.prefill.max_bs) == ("breakable", 1024)
    assert config.source_of("prefill", "max_bs") == J


@pytest.mark.parametrize(
    "argv, phase, key, fragments",
    [
        (
            ["--cuda-graph-bs-decode", "4", "--cuda-graph-compile-sizes-decode", "8"],
            "decode",
            "compile_sizes",
            ["decode.compile_sizes=[8]", "from flag:--cuda-graph-compile-sizes-decode", "sizes among bs [4]"],
        ),
        (
            ["--cuda-graph-bs-decode", "4", "--cuda-graph-config", j({"decode": {"compile_sizes": [16]}})],
            "decode",
            "compile_sizes",
            ["decode.compile_sizes=[16]", "json:--cuda-graph-config"],
        ),
    ],
)
def test_from_args_errors_name_flags(argv, phase, key, fragments):
    ns, _ = parse(argv)
    with pytest.raises(CudaGraphConfigError) as info:
        CudaGraphConfig.from_args(ns)
    assert (info.value.phase, info.value.key) == (phase, key)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_from_args_on_hand_built_namespaces():
    assert CudaGraphConfig.from_args(argparse.Namespace()) == CudaGraphConfig()
    ns = argparse.Namespace(
        cuda_graph_config=j({"decode": {"backend": "full"}}),
        cuda_graph_bs_decode=[4, 2],
        disable_cuda_graph_prefill=False,
    )
    config = CudaGraphConfig.from_args(ns)
    assert (config.decode.backend, config.decode.bs, config.prefill.backend) == ("full", [2, 4], None)
    assert (
        CudaGraphConfig.from_args(argparse.Namespace(cuda_graph_config={"prefill": {"max_bs": 8}})).prefill.max_bs == 8
    )
    with pytest.raises(CudaGraphConfigError) as info:
        CudaGraphConfig.from_args(argparse.Namespace(cuda_graph_max_bs_decode="8"))
    assert "flag:--cuda-graph-max-bs-decode" in str(info.value)
    with pytest.raises(CudaGraphConfigError) as info:
        CudaGraphConfig.from_args(argparse.Namespace(cuda_graph_config="{oops"))
    assert J in str(info.value)


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--cuda-graph-max-bs-decode", "0"], ["--cuda-graph-max-bs-decode", "'0'", "integer >= 1"]),
        (["--cuda-graph-max-bs-prefill", "lots"], ["--cuda-graph-max-bs-prefill", "'lots'"]),
        (["--cuda-graph-bs-decode", "1,x"], ["--cuda-graph-bs-decode", "'1,x'"]),
        (["--cuda-graph-bs-decode", "1,,2"], ["--cuda-graph-bs-decode", "'1,,2'"]),
        (["--cuda-graph-bs-prefill", "-4"], ["--cuda-graph-bs-prefill"]),
        (["--cuda-graph-backend-prefill", "a-b"], ["--cuda-graph-backend-prefill", "'a-b'", "identifier"]),
        (["--cuda-graph-tc-compiler", "jit"], ["--cuda-graph-tc-compiler", "'jit'", "eager"]),
        (["--cuda-graph-tc-compiler-decode", "jit"], ["--cuda-graph-tc-compiler-decode", "'jit'"]),
        (["--cuda-graph-config", "{bad"], ["--cuda-graph-config", "'{bad'", "not valid JSON"]),
        (["--cuda-graph-config", j({"decode": {"max_bs": True}})], ["--cuda-graph-config", "decode.max_bs=True"]),
        (["--cuda-graph-config", j({"verify": {}})], ["--cuda-graph-config", "unknown phase", "'verify'"]),
        (["--cuda-graph-max-bs", "0"], ["--cuda-graph-max-bs", "'0'"]),
    ],
)
def test_bad_flag_values_stop_parsing_naming_flag_and_value(argv, fragments, capsys):
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    for fragment in fragments:
        assert fragment in err


# -- deprecated aliases ----------------------------------------------------------------------

DEPRECATED = [
    # argv (flag given twice where it takes values), expected fields, replacement named in the warning
    (
        ["--disable-cuda-graph"],
        {("decode", "backend"): "disabled", ("prefill", "backend"): "disabled"},
        "--disable-cuda-graph-decode --disable-cuda-graph-prefill",
    ),
    (
        ["--enable-breakable-cuda-graph"],
        {("prefill", "backend"): "breakable"},
        "--cuda-graph-backend-prefill breakable",
    ),
    (["--disable-piecewise-cuda-graph"], {("prefill", "backend"): "disabled"}, "--cuda-graph-backend-prefill disabled"),
    (
        ["--enforce-piecewise-cuda-graph"],
        {("prefill", "backend"): "tc_piecewise"},
        "--cuda-graph-backend-prefill tc_piecewise",
    ),
    (
        ["--cuda-graph-max-bs", "64", "--cuda-graph-max-bs", "96"],
        {("decode", "max_bs"): 96},
        "--cuda-graph-max-bs-decode",
    ),
    (["--cuda-graph-bs", "1", "2", "--cuda-graph-bs", "8,4"], {("decode", "bs"): [4, 8]}, "--cuda-graph-bs-decode"),
    (
        ["--piecewise-cuda-graph-tokens", "256,128", "--piecewise-cuda-graph-tokens", "512"],
        {("prefill", "bs"): [512]},
        "--cuda-graph-bs-prefill",
    ),
    (
        ["--piecewise-cuda-graph-max-tokens", "2048", "--piecewise-cuda-graph-max-tokens", "1024"],
        {("prefill", "max_bs"): 1024},
        "--cuda-graph-max-bs-prefill",
    ),
    (
        ["--piecewise-cuda-graph-compiler", "inductor", "--piecewise-cuda-graph-compiler", "inductor"],
        {("decode", "tc_compiler"): "inductor", ("prefill", "tc_compiler"): "inductor"},
        "--cuda-graph-tc-compiler",
    ),
]


def test_every_legacy_flag_is_covered():
    legacy = {f.option for f in flags_module._FLAGS if f.replacement}
    assert legacy == {argv[0] for argv, _, _ in DEPRECATED}
    assert len(legacy) == 9


@pytest.mark.parametrize("argv, fields, replacement", DEPRECATED, ids=[d[0][0] for d in DEPRECATED])
def test_deprecated_flag_maps_and_warns_once_per_process(argv, fields, replacement):
    ns, caught = parse(argv)
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert caught[0].category is FutureWarning
    assert message.startswith(f"{argv[0]} is deprecated") and replacement in message
    config = CudaGraphConfig.from_args(ns)
    for (phase, key), value in fields.items():
        assert getattr(config[phase], key) == value
        assert config.source_of(phase, key) == f"legacy:{argv[0]}"
    assert set(config.sources) == set(fields)
    # a second parse in the same process maps the same way, silently
    ns_again, caught_again = parse(argv)
    assert caught_again == []
    assert CudaGraphConfig.from_args(ns_again) == config


def test_each_deprecated_flag_warns_for_itself():
    _, caught = parse(["--disable-cuda-graph", "--cuda-graph-max-bs", "8"])
    assert sorted(str(w.message).split()[0] for w in caught) == ["--cuda-graph-max-bs", "--disable-cuda-graph"]


def test_new_flags_do_not_warn():
    _, caught = parse(
        [
            "--cuda-graph-backend-decode",
            "full",
            "--cuda-graph-max-bs-decode",
            "8",
            "--cuda-graph-bs-decode",
            "8",
            "--cuda-graph-tc-compiler-prefill",
            "inductor",
            "--cuda-graph-tc-compiler",
            "eager",
            "--disable-cuda-graph-prefill",
            "--cuda-graph-config",
            "{}",
        ]
    )
    assert caught == []


def test_help_marks_legacy_flags_deprecated_and_docstring_documents_every_flag():
    help_text = make_parser().format_help()
    doc = config_module.__doc__
    expanded = doc.replace("-{decode,prefill}", "-decode") + doc.replace("-{decode,prefill}", "-prefill")
    options = [f.option for f in flags_module._FLAGS] + ["--cuda-graph-config"]
    for option in options:
        assert re.search(re.escape(option) + r"(?![\w-])", help_text), option
        assert re.search(re.escape(option) + r"(?![\w-])", expanded), option
    assert help_text.count("deprecated: use") == 9


def test_compile_sizes_flag_takes_space_and_comma_separated_sizes_and_names_bad_ones(capsys):
    import argparse

    from cuda_graph_runner.config import CudaGraphConfig, CudaGraphConfigError, add_cuda_graph_args

    parser = argparse.ArgumentParser()
    add_cuda_graph_args(parser)
    config = CudaGraphConfig.from_args(parser.parse_args(["--cuda-graph-compile-sizes-decode", "8,1", "4"]))
    assert config.decode.compile_sizes == [1, 4, 8]
    assert config.source_of("decode", "compile_sizes") == "flag:--cuda-graph-compile-sizes-decode"
    assert config.prefill.compile_sizes is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--cuda-graph-compile-sizes-decode", "0"])
    assert "--cuda-graph-compile-sizes-decode" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # no shipped prefill backend reads it: no prefill flag
        parser.parse_args(["--cuda-graph-compile-sizes-prefill", "16"])
    for bad in ([], 4, [True], [0]):
        with pytest.raises(CudaGraphConfigError, match=r"decode\.compile_sizes="):
            CudaGraphConfig.from_dict({"decode": {"compile_sizes": bad}})
    # A size the phase never captures is refused against bs, or max_bs when bs is unset.
    with pytest.raises(CudaGraphConfigError, match=r"\[3\] not captured.*accepted: sizes among bs \[1, 2, 4\]"):
        CudaGraphConfig.from_dict({"decode": {"bs": [1, 2, 4], "compile_sizes": [3, 4]}})
    with pytest.raises(CudaGraphConfigError, match=r"\[64\] not captured.*max_bs 32"):
        CudaGraphConfig.from_dict({"decode": {"max_bs": 32, "compile_sizes": [64]}})
