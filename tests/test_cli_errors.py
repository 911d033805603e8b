"""The command line never shows a traceback for a user's mistake:
explicitly named backends that cannot run fail the bench, argparse errors are short,
deprecated flags warn in one line, exit codes are documented, help and output agree."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from cuda_graph_runner import registry
from cuda_graph_runner.backend.hookspecs import BackendSpec
from cuda_graph_runner.cli.command import main

needs_no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the CPU-only behaviour; this machine has CUDA"
)

TINY = ["--batch-sizes", "1", "--iters", "1", "--warmup", "0", "--steps", "1", "--prompt-len", "2", "--no-prefill"]


def _cli(*argv):
    """Run the console command in a fresh interpreter: (exit status, stdout, stderr)."""
    out = subprocess.run([sys.executable, "-m", "cuda_graph_runner", *argv], capture_output=True, text=True)
    return out.returncode, out.stdout, out.stderr


def test_bench_with_an_unknown_named_backend_exits_2_before_any_work(capsys):
    assert main(["bench", "--decode-backends", "nosuch", *TINY]) == 2
    out, err = capsys.readouterr()
    assert "decode backend 'nosuch'" in err and "unknown cuda graph backend" in err
    assert "Traceback" not in err and "eager ms" not in out


@needs_no_cuda
def test_bench_with_a_named_backend_unavailable_here_exits_1_with_the_reason(capsys):
    assert main(["bench", "--cuda-graph-backend-decode", "full", *TINY]) == 1
    err = capsys.readouterr().err
    assert "decode backend 'full' was asked for (the config) but cannot run" in err and "unavailable" in err


@pytest.fixture()
def broken_contract(tmp_path, monkeypatch):
    (tmp_path / "brokenmod.py").write_text(
        textwrap.dedent("""
        from cuda_graph_runner.backend import DisabledBackend

        class Broken(DisabledBackend):
            def capture_one(self, key, forward_fn):  # lacks post_warmup_hook
                pass
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.register(BackendSpec("broken_contract", "brokenmod:Broken", ("decode",), ("*",), api_version="1.1"))
    yield
    registry.get_registry().unregister("broken_contract")


def test_bench_with_a_contract_broken_named_backend_exits_1_without_traceback(broken_contract, capsys):
    assert main(["bench", "--decode-backends", "broken_contract", *TINY]) == 1
    err = capsys.readouterr().err
    assert "breaks the backend contract" in err and "post_warmup_hook" in err and "Traceback" not in err


def test_bench_with_an_option_the_named_backend_does_not_read_exits_2(capsys):
    from cuda_graph_runner.backend import DisabledBackend

    class PlainBackend(DisabledBackend):
        pass

    registry.register(
        BackendSpec(name="plain_cli", backend_class=PlainBackend, phases=("decode",), devices=("*",), api_version="1.1")
    )
    try:
        assert main(["bench", "--decode-backends", "plain_cli:inductor", *TINY]) == 2
    finally:
        registry.get_registry().unregister("plain_cli")
    err = capsys.readouterr().err
    assert "backend 'plain_cli' does not read option 'tc_compiler'" in err and "tc_piecewise" in err
    assert "Traceback" not in err


def test_bench_label_compiler_error_names_the_flag_it_came_from(capsys):
    """A compiler written in ``--decode-backends`` is reported as from that flag, not as
    from "api" (which the user never wrote)."""
    assert main(["bench", "--decode-backends", "tc_piecewise:bogus", *TINY]) == 2
    err = capsys.readouterr().err
    assert "decode.tc_compiler='bogus' (from flag:--decode-backends): unknown compiler" in err
    assert "(from api)" not in err and "Traceback" not in err


def test_bench_unknown_name_with_a_bad_compiler_is_reported_unknown(capsys):
    assert main(["bench", "--decode-backends", "nosuch:bogus", *TINY]) == 2
    err = capsys.readouterr().err
    assert "unknown cuda graph backend 'nosuch'" in err and "unknown compiler" not in err


def test_bench_label_compiler_for_a_backend_that_reads_none_is_refused_for_the_option(capsys):
    """``breakable:bogus`` once answered "accepted: eager, inductor", and ``breakable:inductor``
    was then refused: a backend that reads no compiler is refused for the option itself."""
    assert main(["bench", "--decode-backends", "breakable:bogus", *TINY]) == 2
    err = capsys.readouterr().err
    assert "backend 'breakable' does not read option 'tc_compiler'" in err and "(from flag:--decode-backends)" in err
    assert "accepted: eager, inductor" not in err and "Traceback" not in err


def test_bench_size_flags_take_spaces_and_commas_like_the_config_flags():
    from cuda_graph_runner.cli.command import build_parser

    args = build_parser().parse_args(
        ["bench", "--batch-sizes", "1,2", "4", "--prefill-tokens", "8,16", "--prefill-requests", "1,3"]
    )
    assert (args.batch_sizes, args.prefill_tokens, args.prefill_requests) == ([1, 2, 4], [8, 16], [1, 3])


@pytest.mark.parametrize("flag", ["--batch-sizes", "--prefill-tokens", "--prefill-requests"])
@pytest.mark.parametrize("value", ["0", "1,x", "-3"])
def test_bench_bad_sizes_are_one_argparse_error_naming_the_value(capsys, flag, value):
    with pytest.raises(SystemExit) as info:
        main(["bench", flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: invalid sizes '{value}'; accepted: integers >= 1" in err
    assert "Traceback" not in err


@needs_no_cuda
def test_bench_chosen_backends_keep_notes_and_the_table_names_the_backend(capsys):
    assert main(["bench", *TINY]) == 0
    out = capsys.readouterr().out
    # With the compiled plugin installed its note says the environment turned it off (below).
    assert "note: no decode graph backend is usable on cpu" in out or "note: decode backend compiled not picked" in out
    assert "decode, backend disabled" in out and "backend eager" not in out


@needs_no_cuda
def test_bench_note_names_the_backend_the_environment_turned_off(capsys, monkeypatch):
    """With CUDA_GRAPH_RUNNER_BENCH_CPU_COMPILED=0 (as in these tests) the bench runs eager
    on the CPU; its note must not leave out the usable backend it did not pick."""
    pytest.importorskip("cuda_graph_runner_compiled", reason="the compiled plugin is not installed")
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_BENCH_CPU_COMPILED", "0")
    assert main(["bench", *TINY]) == 0
    out = capsys.readouterr().out
    assert "note: decode backend compiled not picked (CUDA_GRAPH_RUNNER_BENCH_CPU_COMPILED=0) and no other" in out


@needs_no_cuda
def test_bench_device_cuda_on_a_cpu_only_torch_is_one_error_line(capsys):
    assert main(["bench", "--device", "cuda", *TINY]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --device 'cuda': no cuda device is available here") and "Traceback" not in err


def test_bench_device_that_torch_does_not_know(capsys):
    assert main(["bench", "--device", "banana", *TINY]) == 2
    assert "is not a torch device" in capsys.readouterr().err


def test_argparse_errors_print_the_error_and_see_help_not_the_usage(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--iters", "x"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "cuda-graph-runner bench: error: argument --iters: invalid value 'x'; accepted: an integer >= 1 (digits 0-9)",
        "see 'cuda-graph-runner bench --help'",
    ]


@pytest.mark.parametrize("argv", [[], ["bench"], ["config"], ["backends"]])
def test_help_documents_the_exit_codes(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "exit status:" in out and "2  usage error" in out and "1  runtime failure" in out


def test_deprecated_flag_warns_in_one_clean_line():
    code, out, err = _cli("config", "--cuda-graph-max-bs", "8")
    assert code == 0, err
    lines = [l for l in err.splitlines() if l.strip()]
    assert lines == ["warning: --cuda-graph-max-bs is deprecated and will be removed; use --cuda-graph-max-bs-decode"]


def test_backends_rejects_an_unknown_device_type_with_the_accepted_values(capsys):
    assert main(["backends", "--device-type", "banana"]) == 2
    err = capsys.readouterr().err
    assert "invalid --device-type 'banana'" in err and "cpu" in err and "cuda" in err
    assert main(["backends", "--device-type", "cpu"]) == 0
    assert "default decode backend on cpu" in capsys.readouterr().out


def test_config_help_default_agrees_with_the_printed_config(capsys):
    with pytest.raises(SystemExit):
        main(["config", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "(default: null, meaning the runner's default, 256)" in help_text
    assert "backends_checked" in help_text
    assert main(["config"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["decode"]["max_bs"] is None and report["effective"]["decode"]["max_bs"] == 256
    assert report["effective"]["prefill"]["max_bs"] == 4096
    assert "checked against the installed backends" in report["legend"]["backends_checked"]


# -- found trying the CLI as a new user ------------------------------------------------------------


def test_bad_environment_variable_is_reported_before_any_work(monkeypatch, capsys):
    # The verify variables are read only when a runner is built; `backends` builds none.
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_VERIFY", "maybe")
    assert main(["backends"]) == 2
    err = capsys.readouterr().err
    assert "CUDA_GRAPH_RUNNER_VERIFY='maybe'" in err and "accepted" in err and "Traceback" not in err


def test_bench_json_into_a_missing_folder_fails_before_the_run(tmp_path, capsys):
    target = tmp_path / "no" / "such" / "x.json"
    with pytest.raises(SystemExit) as info:  # refused while the flags are parsed
        main(["bench", "--json", str(target), *TINY])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert str(tmp_path / "no" / "such") in err and "eager ms" not in out and not target.exists()


def test_output_into_a_closed_pipe_ends_quietly():
    # `cuda-graph-runner config | head -c 0`: the reader has left before the command writes.
    cli = subprocess.Popen(
        [sys.executable, "-m", "cuda_graph_runner", "config"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    cli.stdout.close()
    err = cli.stderr.read().decode()
    cli.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_bench_prompt_longer_than_the_model_takes_exits_2_naming_the_limit(capsys):
    argv = ["--batch-sizes", "1", "--iters", "1", "--warmup", "0", "--steps", "1", "--no-prefill"]
    assert main(["bench", "--device", "cpu", *argv, "--prompt-len", "5000"]) == 2
    out, err = capsys.readouterr()
    assert "--prompt-len 5000 plus --steps 1 is 5001 positions" in err
    assert "max_position_embeddings=4096" in err and "Traceback" not in err and "eager ms" not in out


def test_bench_with_every_plugin_filtered_out_names_the_variable_not_the_install(monkeypatch, capsys):
    monkeypatch.setenv(registry.ENV_PLUGINS, "typo")
    registry.reset_registry()
    try:
        with pytest.warns(RuntimeWarning, match="'typo' matches no installed backend"):
            assert main(["bench", "--device", "cpu", *TINY]) == 0
        out = capsys.readouterr().out
        assert "CUDA_GRAPH_RUNNER_PLUGINS='typo' lists the plugins to load" in out
        assert "no graph backend is installed" not in out
    finally:
        monkeypatch.delenv(registry.ENV_PLUGINS)
        registry.reset_registry()


@pytest.mark.parametrize(
    ("argv", "prog"),
    [
        (["bench", "--bogus-flag"], "cuda-graph-runner bench"),
        (["backends", "--bogus-flag"], "cuda-graph-runner backends"),
        (["config", "--bogus-flag"], "cuda-graph-runner config"),
        (["inspect", "--bogus-flag"], "cuda-graph-runner inspect"),
    ],
)
def test_an_unrecognized_flag_points_at_the_help_of_the_command_it_was_given_to(capsys, argv, prog):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{prog}: error: unrecognized arguments: --bogus-flag",
        f"see '{prog} --help'",
    ]


@pytest.mark.parametrize("argv", [["--cuda-graph-max-bs", "4", "bench"], ["--bogus-flag", "backends"]])
def test_a_subcommand_s_flag_before_it_says_where_it_goes(capsys, argv):
    # argparse alone reads the flag's value ("4") as an unknown command.
    assert main(argv) == 2
    flag, command = argv[0], argv[-1]
    assert capsys.readouterr().err.splitlines() == [
        f"cuda-graph-runner: error: {flag} is not an option of cuda-graph-runner itself; a subcommand's options "
        f"go after it: cuda-graph-runner {command} {flag} ...",
        "see 'cuda-graph-runner --help'",
    ]


def test_top_level_options_before_the_subcommand_still_work(capsys):
    assert main(["--log-level", "WARNING", "backends", "--json"]) == 0
    assert capsys.readouterr().out.lstrip().startswith("[")
