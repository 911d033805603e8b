"""The config model: PhaseConfig, CudaGraphConfig, dict/JSON forms, validation, errors."""

from __future__ import annotations

import os
import pathlib
import pickle
import subprocess
import sys

import pytest

from cuda_graph_runner.config import (
    DEFAULT_MAX_BS,
    TC_COMPILERS,
    WELL_KNOWN_DISTRIBUTIONS,
    Backend,
    CudaGraphConfig,
    CudaGraphConfigError,
    Phase,
    PhaseConfig,
)

CORE = pathlib.Path(__file__).resolve().parents[1] / "core"


def test_constants():
    assert Phase.ALL == ("decode", "prefill")
    assert (Backend.FULL, Backend.BREAKABLE, Backend.TC_PIECEWISE, Backend.NPU, Backend.COMPILED, Backend.DISABLED) == (
        "full",
        "breakable",
        "tc_piecewise",
        "npu",
        "compiled",
        "disabled",
    )
    assert WELL_KNOWN_DISTRIBUTIONS == {
        "full": "cuda-graph-runner-full",
        "breakable": "cuda-graph-runner-breakable",
        "tc_piecewise": "cuda-graph-runner-tc-piecewise",
        "npu": "cuda-graph-runner-npu",
        "compiled": "cuda-graph-runner-compiled",
        "disabled": "cuda-graph-runner",
    }
    assert TC_COMPILERS == ("eager", "inductor")
    assert DEFAULT_MAX_BS == {"decode": 256, "prefill": 4096}


# -- PhaseConfig -----------------------------------------------------------------------


def test_phase_defaults_are_auto():
    p = PhaseConfig()
    assert (p.backend, p.max_bs, p.bs, p.tc_compiler) == (None, None, None, "eager")


def test_bs_is_normalised_sorted_and_deduped_into_a_new_list():
    given = [8, 1, 4, 8, 1]
    p = PhaseConfig(bs=given)
    assert p.bs == [1, 4, 8]
    assert given == [8, 1, 4, 8, 1]  # caller's list untouched
    assert PhaseConfig(bs=(2, 1)).bs == [1, 2]
    assert PhaseConfig(bs=[3, 1]) == PhaseConfig(bs=[1, 3])


def test_open_backend_names_are_accepted():
    assert PhaseConfig(backend="acme_gpu").backend == "acme_gpu"


@pytest.mark.parametrize(
    "kwargs, key, fragment",
    [
        (dict(backend=""), "backend", "identifier"),
        (dict(backend="a-b"), "backend", "identifier"),
        (dict(backend="fülL"), "backend", "identifier"),
        (dict(backend=3), "backend", "identifier"),
        (dict(max_bs=0), "max_bs", "integer >= 1"),
        (dict(max_bs=-4), "max_bs", "integer >= 1"),
        (dict(max_bs=True), "max_bs", "not a bool"),
        (dict(max_bs=8.0), "max_bs", "integer >= 1"),
        (dict(max_bs="8"), "max_bs", "integer >= 1"),
        (dict(bs=[]), "bs", "non-empty list"),
        (dict(bs=4), "bs", "non-empty list"),
        (dict(bs="1,2"), "bs", "non-empty list"),
        (dict(bs={1, 2}), "bs", "non-empty list"),
        (dict(bs=[1, 0]), "bs", "non-empty list"),
        (dict(bs=[1, True]), "bs", "not bools"),
        (dict(bs=[1, 2.0]), "bs", "non-empty list"),
        (dict(bs=[1, None]), "bs", "non-empty list"),
        (dict(tc_compiler="jit"), "tc_compiler", "eager, inductor"),
        (dict(tc_compiler=None), "tc_compiler", "eager, inductor"),
    ],
)
def test_phase_config_rejects(kwargs, key, fragment):
    with pytest.raises(CudaGraphConfigError) as info:
        PhaseConfig(**kwargs)
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.phase, err.key) == (None, key)
    assert err.value == kwargs[key]
    assert repr(kwargs[key]) in str(err) and fragment in str(err)


def test_max_bs_equal_to_largest_bs_is_fine():
    assert PhaseConfig(bs=[1, 8], max_bs=8).max_bs == 8


# -- CudaGraphConfig: access, dict, JSON ---------------------------------------------------


def test_getitem_and_unknown_phase():
    c = CudaGraphConfig(decode=PhaseConfig(backend="full"))
    assert c["decode"] is c.decode and c[Phase.PREFILL] is c.prefill
    with pytest.raises(CudaGraphConfigError) as info:
        c["verify"]
    assert info.value.value == "verify" and "'verify'" in str(info.value) and "decode, prefill" in str(info.value)


def test_phases_must_be_phase_configs():
    with pytest.raises(CudaGraphConfigError) as info:
        CudaGraphConfig(decode={"backend": "full"})
    assert info.value.phase == "decode" and "PhaseConfig" in str(info.value)


def test_from_dict_fills_defaults_and_records_sources():
    c = CudaGraphConfig.from_dict({"decode": {"backend": "full", "bs": [4, 2]}, "prefill": {}})
    assert c.decode == PhaseConfig(backend="full", bs=[2, 4])
    assert c.prefill == PhaseConfig()
    assert c.sources == {("decode", "backend"): "api", ("decode", "bs"): "api"}
    assert c.source_of("decode", "bs") == "api"
    assert c.source_of("decode", "max_bs") == "default"
    assert CudaGraphConfig.from_dict({}, source="x") == CudaGraphConfig()


def test_sources_are_not_part_of_equality_or_repr():
    a = CudaGraphConfig.from_dict({"decode": {"backend": "full"}}, source="srcA")
    b = CudaGraphConfig.from_dict({"decode": {"backend": "full"}}, source="srcB")
    assert a == b and repr(a) == repr(b) and "srcA" not in repr(a)


@pytest.mark.parametrize(
    "d, phase, key, value, fragments",
    [
        ([1], None, None, [1], ["must be an object", "accepted"]),
        ({"verify": {}}, None, None, "verify", ["unknown phase", "'verify'", "decode, prefill"]),
        ({1: {}}, None, None, 1, ["unknown phase"]),
        ({"decode": "full"}, "decode", None, "full", ["must be an object", "backend, max_bs, bs, tc_compiler"]),
        ({"decode": None}, "decode", None, None, ["must be an object"]),
        (
            {"decode": {"max_batch": 8}},
            "decode",
            "max_batch",
            8,
            ["unknown key", "decode.max_batch=8", "backend, max_bs, bs, tc_compiler"],
        ),
        ({"prefill": {"max_bs": "8"}}, "prefill", "max_bs", "8", ["prefill.max_bs='8'", "integer >= 1"]),
        ({"decode": {"torch_compile": "tvm"}}, "decode", "torch_compile", "tvm", ["'tvm'", "true or a compiler"]),
        ({"decode": {"tc_compiler": "aot"}}, "decode", "tc_compiler", "aot", ["'aot'", "eager, inductor"]),
    ],
)
def test_from_dict_errors_name_phase_key_value_and_accepted(d, phase, key, value, fragments):
    with pytest.raises(CudaGraphConfigError) as info:
        CudaGraphConfig.from_dict(d)
    err = info.value
    assert (err.phase, err.key, err.value) == (phase, key, value)
    assert err.accepted
    for fragment in fragments:
        assert fragment in str(err)


def test_to_dict_exports_only_non_defaults():
    assert CudaGraphConfig().to_dict() == {}
    c = CudaGraphConfig(
        decode=PhaseConfig(backend="full", tc_compiler="eager"),
        prefill=PhaseConfig(max_bs=2048, bs=[16, 8], tc_compiler="inductor"),
    )
    assert c.to_dict() == {
        "decode": {"backend": "full"},
        "prefill": {"max_bs": 2048, "bs": [8, 16], "tc_compiler": "inductor"},
    }
    assert CudaGraphConfig.from_dict(c.to_dict()) == c
    c.to_dict()["prefill"]["bs"].append(99)  # exported lists are copies
    assert c.prefill.bs == [8, 16]


def test_from_json_text_file_and_pathlike(tmp_path):
    text = '{"decode": {"backend": "breakable", "max_bs": 64}}'
    expected = CudaGraphConfig(decode=PhaseConfig(backend="breakable", max_bs=64))
    assert CudaGraphConfig.from_json(text) == expected
    assert CudaGraphConfig.from_json(text).source_of("decode", "max_bs") == "json"
    f = tmp_path / "cg.json"
    f.write_text(text)
    assert CudaGraphConfig.from_json(str(f)) == expected
    assert CudaGraphConfig.from_json(f) == expected
    assert CudaGraphConfig.from_json(f, source="file").source_of("decode", "backend") == "file"


def test_from_json_a_path_under_home_and_a_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "cg.json").write_text('{"decode": {"backend": "full"}}')
    assert CudaGraphConfig.from_json("~/cg.json").decode.backend == "full"
    (tmp_path / "d.json").mkdir()
    with pytest.raises(CudaGraphConfigError, match="is a directory, not a file"):
        CudaGraphConfig.from_json(str(tmp_path / "d.json"))
    with pytest.raises(CudaGraphConfigError, match=r"no such file \(" + str(tmp_path)):
        CudaGraphConfig.from_json("~/nope.json")


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("{bad", ["not valid JSON", "not an existing file", "'{bad'"]),
        ("", ["not valid JSON"]),
        ("no/such/file.json", ["no such file", "'no/such/file.json'"]),
        ("cg.JSON", ["no such file", "'cg.JSON'"]),
        ("no/such/file", ["not valid JSON", "not an existing file"]),
        ("[]", ["must be an object"]),
        ('{"decode": {}, "decode": {}}', ["duplicate key", "'decode'"]),
        ('{"decode": {"bs": [1], "bs": [2]}}', ["duplicate key", "'bs'"]),
        ("[" * 100_000, ["nested too deeply"]),
        ('{"decode": {"max_bs": ' + "9" * 5000 + "}}", ["not valid JSON"]),
    ],
)
def test_from_json_errors(text, fragments):
    with pytest.raises(CudaGraphConfigError) as info:
        CudaGraphConfig.from_json(text)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_from_json_unreadable_file_and_wrong_type(tmp_path):
    f = tmp_path / "binary.json"
    f.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(CudaGraphConfigError, match="cannot read the file"):
        CudaGraphConfig.from_json(f)
    with pytest.raises(CudaGraphConfigError, match="must be JSON text or a path"):
        CudaGraphConfig.from_json(b'{"decode": {}}')
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    with pytest.raises(CudaGraphConfigError, match="in file"):
        CudaGraphConfig.from_json(str(bad))


# -- derivation ------------------------------------------------------------------------------


def test_with_phase_copies_and_records_api_source():
    base = CudaGraphConfig.from_dict({"decode": {"bs": [1, 2]}, "prefill": {"bs": [16]}}, source="json")
    new = base.with_phase("decode", backend="full", bs=[4, 2])
    assert new.decode == PhaseConfig(backend="full", bs=[2, 4])
    assert base.decode == PhaseConfig(bs=[1, 2])  # original unchanged
    assert new.prefill == base.prefill and new.prefill is not base.prefill
    assert new.prefill.bs is not base.prefill.bs
    assert new.source_of("decode", "backend") == "api" and new.source_of("prefill", "bs") == "json"
    assert base.source_of("decode", "backend") == "default"


def test_with_phase_errors():
    c = CudaGraphConfig()
    with pytest.raises(CudaGraphConfigError) as info:
        c.with_phase("decode", max_batch=3)
    assert (info.value.phase, info.value.key, info.value.value) == ("decode", "max_batch", 3)
    with pytest.raises(CudaGraphConfigError) as info:
        c.with_phase("prefill", max_bs=0)
    assert (info.value.phase, info.value.key) == ("prefill", "max_bs") and "from api" in str(info.value)
    with pytest.raises(CudaGraphConfigError):
        c.with_phase("both", backend="full")


def test_fully_disabled():
    off = PhaseConfig(backend="disabled")
    assert CudaGraphConfig(decode=off, prefill=PhaseConfig(backend="disabled")).fully_disabled()
    assert not CudaGraphConfig(decode=off).fully_disabled()  # prefill auto is not disabled
    assert not CudaGraphConfig().fully_disabled()


# -- validate --------------------------------------------------------------------------------

INSTALLED = {
    "full": frozenset({"decode"}),
    "breakable": frozenset({"decode", "prefill"}),
    "acme": frozenset({"decode"}),
}


def test_validate_accepts_installed_auto_and_disabled():
    c = CudaGraphConfig(decode=PhaseConfig(backend="acme"), prefill=PhaseConfig(backend="breakable"))
    c.validate(INSTALLED)
    CudaGraphConfig().validate({})  # auto is the registry's business
    CudaGraphConfig(decode=PhaseConfig(backend="disabled")).validate({})  # built into the core
    CudaGraphConfig(decode=PhaseConfig(backend="not_installed")).validate()  # no registry: names unchecked


def test_validate_unknown_well_known_name_names_distribution():
    c = CudaGraphConfig.from_dict({"prefill": {"backend": "tc_piecewise"}}, source="flag:--x")
    with pytest.raises(CudaGraphConfigError) as info:
        c.validate(INSTALLED)
    err, text = info.value, str(info.value)
    assert (err.phase, err.key, err.value, err.source) == ("prefill", "backend", "tc_piecewise", "flag:--x")
    assert "pip install cuda-graph-runner-tc-piecewise" in text
    assert "installed: acme, breakable, full" in text
    assert "breakable, disabled" in err.accepted  # what prefill could use


def test_validate_unknown_plugin_name_lists_missing_well_known():
    c = CudaGraphConfig(decode=PhaseConfig(backend="vendor_x"))
    with pytest.raises(CudaGraphConfigError) as info:
        c.validate(INSTALLED)
    text = str(info.value)
    assert "'vendor_x'" in text and "installed: acme, breakable, full" in text
    assert "npu (cuda-graph-runner-npu)" in text and "full (" not in text


def test_validate_backend_not_allowed_for_phase():
    c = CudaGraphConfig(prefill=PhaseConfig(backend="acme"))
    with pytest.raises(CudaGraphConfigError) as info:
        c.validate(INSTALLED)
    err = info.value
    assert (err.phase, err.key, err.value) == ("prefill", "backend", "acme")
    assert "does not support phase 'prefill'" in str(err) and "supports: decode" in str(err)


def test_validate_rechecks_fields_assigned_after_construction():
    c = CudaGraphConfig.from_dict({"decode": {"max_bs": 8}}, source="json")
    c.decode.max_bs = 0
    with pytest.raises(CudaGraphConfigError) as info:
        c.validate()
    assert (info.value.phase, info.value.key, info.value.source) == ("decode", "max_bs", "json")


# -- the error type ------------------------------------------------------------------------


def test_error_pickles_with_attributes():
    err = CudaGraphConfigError("bad", phase="decode", key="bs", value=[0], accepted="ints", source="json")
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is CudaGraphConfigError and str(copy) == str(err)
    assert (copy.phase, copy.key, copy.value, copy.accepted, copy.source) == ("decode", "bs", [0], "ints", "json")


def test_error_without_value_omits_it():
    err = CudaGraphConfigError("broken")
    assert str(err) == "invalid cuda-graph config: broken" and err.value is None


# -- import weight ------------------------------------------------------------------------------


@pytest.mark.parametrize("module", ["cuda_graph_runner.config", "cuda_graph_runner.cli.config_command"])
def test_import_does_not_pull_torch(module):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CORE), env.get("PYTHONPATH")]))
    code = f"import sys; import {module}; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_package_exports_every_public_name():
    """The config is a package (model / flags / loading); its users import from the top."""
    import cuda_graph_runner.config as package

    names = set(package.__all__) | {"source_phases", "SOURCE_DEFAULT", "SOURCE_API", "SOURCE_JSON", "SOURCE_JSON_FLAG"}
    assert {name for name in names if not hasattr(package, name)} == set()
    assert package.CudaGraphConfig.__module__ == "cuda_graph_runner.config.model"
