"""Property tests: round trips for valid configs, only CudaGraphConfigError for garbage."""

from __future__ import annotations

import argparse
import json
import math

from hypothesis import example, given, settings
from hypothesis import strategies as st

from cuda_graph_runner.config import (
    MAX_CAPTURE_SIZE,
    PHASE_KEYS,
    TC_COMPILERS,
    CudaGraphConfig,
    CudaGraphConfigError,
    PhaseConfig,
    add_cuda_graph_args,
)

backend_names = (
    st.none()
    | st.sampled_from(["full", "breakable", "tc_piecewise", "npu", "disabled"])
    | st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True)
)
sizes = st.integers(min_value=1, max_value=MAX_CAPTURE_SIZE)  # the documented cap


@st.composite
def phase_configs(draw, decode=False):
    bs = draw(st.none() | st.lists(sizes, min_size=1, max_size=12))
    max_bs = draw(st.none() | sizes)
    backend = draw(backend_names)
    # Decode tc_compiler with full (or auto) is the deprecated spelling of torch_compile,
    # rewritten on load: not a fixed point of the round trip.
    compilers = ["eager"] if decode and backend in (None, "full") else TC_COMPILERS
    return PhaseConfig(backend=backend, max_bs=max_bs, bs=bs, tc_compiler=draw(st.sampled_from(compilers)))


configs = st.builds(CudaGraphConfig, decode=phase_configs(decode=True), prefill=phase_configs())


@given(configs)
def test_dict_round_trip(config):
    exported = config.to_dict()
    again = CudaGraphConfig.from_dict(exported)
    assert again == config
    assert again.to_dict() == exported
    # only non-defaults are exported, and each exported key is recorded as set
    assert set(again.sources) == {(phase, key) for phase, keys in exported.items() for key in keys}


@given(configs)
def test_json_and_flag_round_trip(config):
    text = json.dumps(config.to_dict())
    assert CudaGraphConfig.from_json(text) == config
    parser = argparse.ArgumentParser()
    add_cuda_graph_args(parser)
    assert CudaGraphConfig.from_args(parser.parse_args(["--cuda-graph-config", text])) == config


@given(st.lists(sizes, min_size=1, max_size=30))
def test_bs_normalisation_is_sorted_set_and_idempotent(bs):
    normalised = PhaseConfig(bs=bs).bs
    assert normalised == sorted(set(bs))
    assert PhaseConfig(bs=normalised).bs == normalised


# -- garbage in, CudaGraphConfigError out ----------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=True)
    | st.text(max_size=12)
    | st.sampled_from(["full", "disabled", "eager", "inductor", "a-b", ""])
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
python_values = json_values | st.tuples(sizes, sizes) | st.frozensets(sizes, max_size=3) | st.binary(max_size=4)
phase_names = st.sampled_from(["decode", "prefill"]) | st.text(max_size=8) | st.integers()
key_names = st.sampled_from(list(PHASE_KEYS)) | st.text(max_size=8) | st.integers()
settings_dicts = st.dictionaries(key_names, python_values, max_size=5)
config_dicts = st.dictionaries(phase_names, settings_dicts | python_values, max_size=3)


def only_config_errors(call):
    """Run call; it may succeed or raise CudaGraphConfigError, nothing else."""
    try:
        return call()
    except CudaGraphConfigError as err:
        assert str(err).startswith("invalid cuda-graph config")
        return None


@given(config_dicts | python_values)
@example({"decode": {"bs": [1, math.nan]}})
@example({"decode": {"bs": [[1]]}})
@example({"prefill": {"max_bs": 1 << 70, "bs": [2]}})
def test_random_dicts_raise_only_config_errors(d):
    result = only_config_errors(lambda: CudaGraphConfig.from_dict(d))
    if result is not None:
        assert CudaGraphConfig.from_dict(result.to_dict()) == result


def _mangled_json():
    """JSON text near a config (JSON-only values), sometimes with a few characters spliced in."""
    json_keys = st.sampled_from(list(PHASE_KEYS)) | st.text(max_size=8)
    json_configs = st.dictionaries(
        st.sampled_from(["decode", "prefill"]) | st.text(max_size=8),
        st.dictionaries(json_keys, json_values, max_size=5) | json_values,
        max_size=3,
    )
    valid = st.builds(json.dumps, json_configs | json_values)
    return valid | st.tuples(valid, st.integers(min_value=0, max_value=40), st.text(max_size=3)).map(
        lambda t: t[0][: t[1]] + t[2] + t[0][t[1] :]
    )


@settings(max_examples=300)
@given(st.text(max_size=60) | _mangled_json())
@example("[" * 50_000)
@example('{"decode": {"max_bs": ' + "7" * 5000 + "}}")
@example('{"decode": {"max_bs": NaN}}')
@example('{"decode": {"bs": [1e400]}}')
@example('{"decode": {"backend": "full", "backend": "full"}}')
@example("\x00")
@example("/")
def test_random_json_text_raises_only_config_errors(text):
    only_config_errors(lambda: CudaGraphConfig.from_json(text))
