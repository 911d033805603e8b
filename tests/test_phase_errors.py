"""A backend asked for a phase its spec does not list is refused for the phase (the same
on every device), in the Python API, ``bench`` and ``config`` alike, and the per-phase
``--cuda-graph-backend-*`` help lists only that phase's backends."""

from __future__ import annotations

import pytest

from cuda_graph_runner import registry
from cuda_graph_runner.backend.errors import BackendUnavailableError
from cuda_graph_runner.cli.command import build_parser, main
from cuda_graph_runner.config import Backend

pytestmark = pytest.mark.skipif(
    "compiled" not in registry.backend_phases(),
    reason="needs the decode-only backend 'compiled' (cuda-graph-runner-compiled)",
)


def test_runner_for_prefill_with_a_decode_only_backend_names_the_phase():
    from cuda_graph_runner import PrefillCudaGraphRunner
    from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM

    model = ReferenceLlamaForCausalLM.from_preset("tiny")
    with pytest.raises(BackendUnavailableError) as info:
        PrefillCudaGraphRunner(model, {"prefill": {"backend": "compiled"}}, device="cpu")
    message = str(info.value)
    assert "does not support phase 'prefill'" in message and "runs on" not in message


@pytest.mark.parametrize(
    "flags", [["--prefill-backends", "compiled"], ["--cuda-graph-backend-prefill", "compiled"]], ids=["label", "config"]
)
def test_bench_prefill_with_a_decode_only_backend_is_a_usage_error(flags, capsys):
    assert main(["bench", *flags, "--batch-sizes", "1"]) == 2
    err = capsys.readouterr().err
    assert "backend 'compiled' is for decode only; accepted for prefill:" in err and "runs on" not in err


def test_config_prefill_with_a_decode_only_backend_is_a_usage_error(capsys):
    assert main(["config", "--cuda-graph-backend-prefill", "compiled"]) == 2
    assert "does not support phase 'prefill'" in capsys.readouterr().err


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_backend_flag_help_lists_the_phase_backends(phase):
    help_text = next(
        a.help
        for a in build_parser()._subparsers._group_actions[0].choices["config"]._actions
        if a.option_strings == [f"--cuda-graph-backend-{phase}"]
    )
    listed = help_text.split(":", 1)[1].split(" or ")[0].replace(",", " ").split()
    assert listed == list(Backend.FOR_PHASE[phase])
    installed = registry.backend_phases()
    for name in Backend.WELL_KNOWN:
        if name in installed:  # the installed specs agree with the list
            assert (phase in installed[name]) == (name in listed), (name, installed[name])
