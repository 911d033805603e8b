"""Config bounds and robustness: a UTF-8 BOM is accepted, sizes are
capped at MAX_CAPTURE_SIZE, and every bad value raises CudaGraphConfigError (never
MemoryError, ValueError from printing a huge int, or anything else)."""

from __future__ import annotations

import argparse
import json
import math
import warnings

import pytest

from cuda_graph_runner.config import (
    MAX_CAPTURE_SIZE,
    CudaGraphConfig,
    CudaGraphConfigError,
    PhaseConfig,
    add_cuda_graph_args,
)

HUGE = 10**5000  # more digits than Python >= 3.11 prints (int_max_str_digits)


def test_config_file_with_a_utf8_bom_is_accepted(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"decode": {"max_bs": 8}}).encode())
    assert CudaGraphConfig.from_json(str(path)).decode.max_bs == 8
    assert CudaGraphConfig.from_json(path).decode.max_bs == 8  # PathLike too
    assert CudaGraphConfig.from_json('\ufeff{"prefill": {"max_bs": 16}}').prefill.max_bs == 16  # BOM kept in text


def test_config_file_with_a_bom_through_the_flag(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text('\ufeff{"decode": {"backend": "disabled"}}', encoding="utf-8")
    parser = argparse.ArgumentParser()
    add_cuda_graph_args(parser)
    config = CudaGraphConfig.from_args(parser.parse_args(["--cuda-graph-config", str(path)]))
    assert config.decode.backend == "disabled"


def test_the_maximum_itself_is_accepted():
    assert PhaseConfig(max_bs=MAX_CAPTURE_SIZE, bs=[1, MAX_CAPTURE_SIZE]).max_bs == MAX_CAPTURE_SIZE
    assert MAX_CAPTURE_SIZE == 65536


@pytest.mark.parametrize(
    "fields,fragment",
    [
        ({"max_bs": MAX_CAPTURE_SIZE + 1}, "above the maximum capture size 65536"),
        ({"max_bs": 10**8}, "above the maximum capture size"),
        ({"max_bs": 10**12}, "above the maximum capture size"),
        ({"max_bs": HUGE}, "<integer of"),
        ({"bs": [1, 10**8]}, "above the maximum capture size"),
        ({"bs": [HUGE]}, "above the maximum capture size"),
        ({"bs": [-HUGE]}, "not a positive integer"),
    ],
    ids=lambda v: type(v).__name__,
)
def test_sizes_above_the_cap_raise_a_config_error_that_prints(fields, fragment):
    with pytest.raises(CudaGraphConfigError) as info:
        CudaGraphConfig.from_dict({"decode": fields})
    text = str(info.value)  # must not raise ValueError for a huge int
    assert fragment in text and "decode." in text and "65536" in text


def test_huge_integers_in_json_text_are_config_errors():
    with pytest.raises(CudaGraphConfigError, match="not valid JSON"):
        CudaGraphConfig.from_json('{"decode": {"max_bs": ' + "9" * 5000 + "}}")


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--cuda-graph-max-bs-decode", "100000"),
        ("--cuda-graph-max-bs-prefill", "9" * 5000),
        ("--cuda-graph-bs-decode", "1,70000"),
        ("--cuda-graph-max-bs", str(10**12)),
    ],
)
def test_flags_above_the_cap_are_argparse_errors(flag, value, capsys):
    parser = argparse.ArgumentParser()
    add_cuda_graph_args(parser)
    with pytest.raises(SystemExit) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # --cuda-graph-max-bs is a deprecated alias
        parser.parse_args([flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "65536" in err


class _BadRepr:
    def __repr__(self):
        raise RuntimeError("no repr")


BAD_VALUES = [
    0,
    -1,
    True,
    False,
    1.5,
    math.nan,
    math.inf,
    "8",
    b"8",
    [],
    {},
    [[1]],
    {"a": 1},
    _BadRepr(),
    HUGE,
    -HUGE,
    10**8,
    [HUGE],
    [0],
    [True],
    ["1"],
    [1.0],
    (),
    "x" * 100000,
]


@pytest.mark.parametrize("key", ["backend", "max_bs", "bs", "tc_compiler"])
@pytest.mark.parametrize("value", BAD_VALUES, ids=lambda v: type(v).__name__)
def test_every_bad_value_is_a_config_error(key, value):
    if key == "backend" and isinstance(value, str) and value.isidentifier():
        pytest.skip("an identifier is a valid backend name")
    try:
        CudaGraphConfig.from_dict({"prefill": {key: value}})
    except CudaGraphConfigError as err:
        assert str(err).startswith("invalid cuda-graph config prefill.")
    else:
        pytest.fail(f"{key}={type(value).__name__} value accepted")


@pytest.mark.parametrize(
    "document",
    [
        {HUGE: {}},
        {"decode": {HUGE: 1}},
        {"decode": HUGE},
        HUGE,
        [HUGE],
        {"decode": {"bs": {HUGE: 1}}},
    ],
    ids=lambda d: type(d).__name__,
)
def test_bad_documents_with_unprintable_parts_are_config_errors(document):
    with pytest.raises(CudaGraphConfigError) as info:
        CudaGraphConfig.from_dict(document)
    assert str(info.value)
