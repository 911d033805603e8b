"""The conformance kit itself: device tests skip with the backend's reason, silent
overrides and missing configuration are caught, and the kit is opt-in (no pytest11)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from importlib import metadata

import pytest
import torch

from cuda_graph_runner.testing import conformance

SUITE = """
import pytest
from cuda_graph_runner.testing.conformance import BackendConformanceTests


class TestFullUnmarked(BackendConformanceTests):
    backend_name = "full"


class TestSilentOverride(BackendConformanceTests):
    backend_name = "disabled"

    def test_probe_answers_for_every_device_type(self):
        pass  # weakened without saying so

    @pytest.mark.xfail(reason="documented deviation")
    def test_unsupported_phase_is_refused_by_name(self):
        raise AssertionError("deviation")


class TestNoName(BackendConformanceTests):
    pass


class TestNotInstalled(BackendConformanceTests):
    backend_name = "acme_not_installed"
"""


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("kit")
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "test_kit_suite.py").write_text(textwrap.dedent(SUITE))
    tests = [
        "TestFullUnmarked and test_device",
        "TestSilentOverride and (no_standard or unsupported_phase)",
        "TestNoName and test_entry_point",
        "TestNotInstalled and (test_entry_point or test_listed)",
    ]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={root / 'r.xml'}",
            "-k",
            " or ".join(f"({t})" for t in tests),
            str(root / "test_kit_suite.py"),
        ],
        cwd=root,
        capture_output=True,
        text=True,
    )
    result = {}
    for case in ET.parse(root / "r.xml").getroot().iter("testcase"):
        name = f"{case.get('classname').split('.')[-1]}::{case.get('name')}"
        verdict = next(iter(case), None)
        result[name] = (
            verdict.tag if verdict is not None else "passed",
            (verdict.get("message") or "") if verdict is not None else "",
        )
    return result


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU skip reason; this machine has CUDA")
def test_device_tests_skip_with_the_backends_reason(outcomes):
    device = {k: v for k, v in outcomes.items() if k.startswith("TestFullUnmarked::test_device")}
    assert len(device) == len(conformance._DEVICE_TESTS) == 10, outcomes
    decode = device["TestFullUnmarked::test_device_decode_capture_replay_matches_eager"]
    assert decode[0] == "skipped" and decode[1].startswith("backend 'full' unavailable here: "), decode
    assert "CUDA" in decode[1]  # the probe's own words, e.g. "torch 2.13.0+cpu is built without CUDA"
    prefill = device["TestFullUnmarked::test_device_prefill_capture_replay_matches_eager"]
    assert prefill[0] == "skipped" and prefill[1].startswith("backend 'full' unavailable here: "), prefill
    assert all(v[0] == "skipped" and v[1] for v in device.values())  # never silently


def test_silent_override_fails_and_a_documented_one_is_allowed(outcomes):
    verdict, message = outcomes["TestSilentOverride::test_no_standard_test_is_overridden_silently"]
    assert verdict == "failure"
    assert "overrides standard test(s) ['test_probe_answers_for_every_device_type'] without" in message
    assert outcomes["TestSilentOverride::test_unsupported_phase_is_refused_by_name"][0] == "skipped"  # xfail


def test_missing_backend_name_is_reported(outcomes):
    verdict, message = outcomes["TestNoName::test_entry_point_is_installed"]
    assert verdict == "error" and "TestNoName: set the class attribute backend_name" in message


def test_backend_not_installed_fails_discovery_with_guidance(outcomes):
    verdict, message = outcomes["TestNotInstalled::test_entry_point_is_installed"]
    assert (
        verdict == "failure" and "no entry point 'acme_not_installed' in group 'cuda_graph_runner.backends'" in message
    )
    verdict, message = outcomes["TestNotInstalled::test_listed_with_distribution_and_version"]
    assert verdict == "failure" and "list_backends() lacks 'acme_not_installed'" in message


def test_kit_is_opt_in_not_a_pytest11_plugin():
    ours = [
        ep for ep in metadata.entry_points(group="pytest11") if ep.dist and ep.dist.name.startswith("cuda-graph-runner")
    ]
    assert ours == []
    import cuda_graph_runner.testing.conformance as kit

    assert not hasattr(kit, "pytest_configure") and not hasattr(kit, "pytest_collection_modifyitems")


def test_assert_close_compares_token_ids_exactly_and_logits_within_tolerance():
    kit = conformance.BackendConformanceTests()
    kit.atol = kit.rtol = 0.05  # wide enough that a float comparison would admit tokens one id apart
    tokens = torch.tensor([[200, 7], [30000, 12]])
    kit.assert_close(tokens.clone(), tokens, "greedy tokens")
    with pytest.raises(AssertionError, match="greedy tokens: graph output differs from eager"):
        kit.assert_close(tokens + torch.tensor([[0, 0], [1, 0]]), tokens, "greedy tokens")
    logits = torch.tensor([[1.0, 2.0]])
    kit.assert_close((logits + 0.01, tokens), (logits, tokens.clone()), "logits and tokens")
    with pytest.raises(AssertionError, match="logits and tokens"):
        kit.assert_close((logits + 0.01, tokens - 1), (logits, tokens), "logits and tokens")
    with pytest.raises(AssertionError):
        kit.assert_close(logits + 1.0, logits, "logits")
