"""Backend options: each backend's spec declares the options it reads;
an option the selected backend does not read is an error naming the backends that read it."""

from __future__ import annotations

import pytest

from cuda_graph_runner.backend import DisabledBackend
from cuda_graph_runner.backend import options as backend_options
from cuda_graph_runner.backend.hookspecs import BackendSpec
from cuda_graph_runner.config import CudaGraphConfig, CudaGraphConfigError, PhaseConfig
from cuda_graph_runner.registry import BackendRegistry


class PlainBackend(DisabledBackend):
    pass


class ReaderBackend(DisabledBackend):
    pass


def _spec(name, backend_class=ReaderBackend, options=(), phases=("decode", "prefill")):
    return BackendSpec(
        name=name, backend_class=backend_class, phases=phases, devices=("*",), api_version="1.1", options=options
    )


@pytest.fixture()
def reg():
    r = BackendRegistry(autoload=False)
    r.register(_spec("plain", PlainBackend))
    r.register(_spec("reader", options=("tc_compiler",)))
    return r


def test_an_option_the_backend_does_not_read_is_an_error_naming_who_reads_it(reg):
    config = CudaGraphConfig.from_dict({"decode": {"backend": "plain", "tc_compiler": "inductor"}})
    with pytest.raises(CudaGraphConfigError) as info:
        reg.resolve("decode", config, device="cpu")
    text = str(info.value)
    assert "decode.tc_compiler='inductor'" in text and "backend 'plain' does not read option 'tc_compiler'" in text
    assert "backends that read it: reader" in text and "(from api)" in text


def test_explicitly_set_default_value_counts_as_set(reg):
    config = CudaGraphConfig.from_dict({"decode": {"backend": "plain", "tc_compiler": "eager"}})
    with pytest.raises(CudaGraphConfigError, match="does not read option 'tc_compiler'"):
        reg.resolve("decode", config, device="cpu")


def test_a_phase_config_without_sources_is_checked_by_value(reg):
    with pytest.raises(CudaGraphConfigError, match="backend 'plain' does not read"):
        reg.resolve("decode", PhaseConfig(backend="plain", tc_compiler="inductor"), device="cpu")
    assert type(reg.resolve("decode", PhaseConfig(backend="plain"), device="cpu")) is PlainBackend


def test_a_backend_that_reads_the_option_and_disabled_are_accepted(reg):
    config = CudaGraphConfig.from_dict(
        {
            "decode": {"backend": "reader", "tc_compiler": "inductor"},
            "prefill": {"backend": "disabled", "tc_compiler": "inductor"},
        }
    )
    assert type(reg.resolve("decode", config, device="cpu")) is ReaderBackend
    assert reg.resolve("prefill", config, device="cpu").name == "disabled"  # no graphs: options ignored


def test_a_both_phase_flag_needs_one_phase_that_reads_it(reg):
    import argparse

    from cuda_graph_runner.config import add_cuda_graph_args

    parser = argparse.ArgumentParser()
    add_cuda_graph_args(parser)

    def flags(prefill: str) -> CudaGraphConfig:
        """tc_compiler set for both phases; decode backend ``plain`` (does not read it)."""
        args = f"--cuda-graph-tc-compiler inductor --cuda-graph-backend-decode plain --cuda-graph-backend-prefill {prefill}"
        return CudaGraphConfig.from_args(parser.parse_args(args.split()))

    both = flags("reader")
    assert type(reg.resolve("decode", both, device="cpu")) is PlainBackend  # the other phase reads it
    backend_options.check_with_registry(both, reg, "cpu")
    neither = flags("plain")
    # sglang's flag keeps sglang's meaning (tc_piecewise's compiler): ignored, with a warning.
    with pytest.warns(UserWarning) as record:
        backend_options.check_with_registry(neither, reg, "cpu")
    text = str(record[0].message)
    assert "decode backend 'plain' and prefill backend 'plain' do not read" in text and "ignored" in text
    assert "flag:--cuda-graph-tc-compiler" in text and "--enable-torch-compile" in text


def test_options_must_be_a_tuple_of_strings(reg):
    with pytest.raises(ValueError, match="options 'tc_compiler' must be a tuple"):
        reg.register(
            BackendSpec(
                name="bad", backend_class=PlainBackend, phases=("decode",), devices=("*",), options="tc_compiler"
            )
        )


def test_shipped_plugins_declare_what_they_read():
    from cuda_graph_runner_breakable import plugin as breakable
    from cuda_graph_runner_full import plugin as full
    from cuda_graph_runner_npu import plugin as npu
    from cuda_graph_runner_tc_piecewise import plugin as tc

    reads = {s.name: s.options for m in (full, breakable, tc, npu) for s in m.cuda_graph_runner_backend_specs()}
    assert reads == {
        "full": ("compile_sizes", "torch_compile", "torch_compile_max_bs"),
        "breakable": (),
        "tc_piecewise": ("tc_compiler",),
        "npu": (),
    }


def test_check_with_registry_reads_the_options_of_a_registry_not_yet_scanned():
    """``bench --cuda-graph-backend-decode full --cuda-graph-tc-compiler-decode inductor``
    once said full does not read tc_compiler: the selected backend's options were read
    from the entries before the first scan filled them."""
    from types import SimpleNamespace

    from cuda_graph_runner.backend.options import check_with_registry
    from cuda_graph_runner.config import CudaGraphConfig

    class LazyRegistry:
        def __init__(self):
            self._entries = {}

        def names(self):
            spec = SimpleNamespace(options=("compile_sizes", "torch_compile"))
            self._entries = {"full": SimpleNamespace(name="full", spec=spec)}
            return ["full"]

        def default_backend(self, phase, device_type):
            return "full"

    config = CudaGraphConfig.from_dict({"decode": {"backend": "full", "torch_compile": "inductor"}})
    check_with_registry(config, LazyRegistry(), "cpu")  # no error: full reads it


@pytest.fixture()
def compiling_reg(reg):
    reg.register(_spec("sized", options=("torch_compile", "compile_sizes")))
    return reg


@pytest.mark.parametrize("compiler", [None, False])
def test_compile_sizes_without_a_compiler_are_refused_at_resolve(compiling_reg, compiler):
    """``full`` with compile sizes and torch_compile off compiles nothing: refused when the
    backend is resolved (before any model work), naming the value and what to set."""
    decode = {"backend": "sized", "compile_sizes": [1, 2], **({"torch_compile": compiler} if compiler is False else {})}
    config = CudaGraphConfig.from_dict({"decode": decode})
    with pytest.raises(CudaGraphConfigError) as info:
        compiling_reg.resolve("decode", config, device="cpu")
    text = str(info.value)
    assert "decode.compile_sizes=[1, 2]" in text and "compiles nothing with torch_compile off" in text
    assert "set decode.torch_compile" in text


def test_compile_sizes_with_a_compiler_resolve(compiling_reg):
    config = CudaGraphConfig.from_dict({"decode": {"backend": "sized", "torch_compile": True, "compile_sizes": [1]}})
    assert compiling_reg.resolve("decode", config, device="cpu").name == "sized"


def test_compile_sizes_rule_only_for_backends_reading_both(compiling_reg):
    """A backend reading ``compile_sizes`` but not ``torch_compile`` (its own compiler) is
    not held to the torch_compile rule."""
    compiling_reg.register(_spec("own_compiler", options=("compile_sizes",), phases=("decode",)))
    config = CudaGraphConfig.from_dict({"decode": {"backend": "own_compiler", "compile_sizes": [4]}})
    assert compiling_reg.resolve("decode", config, device="cpu").name == "own_compiler"


def test_declared_reads_say_nothing_for_unknown_failed_or_contested_names():
    """The bench refuses ``name:compiler`` for a backend whose spec reads no compiler; a
    plugin that failed or is in conflict must keep its own error (review: a failed
    ``tc_piecewise`` was reported as not reading ``tc_compiler``)."""
    from types import SimpleNamespace

    spec = SimpleNamespace(options=("tc_compiler",))
    registry = SimpleNamespace(
        _entries={
            "ok": SimpleNamespace(spec=spec, status="available"),
            "plain": SimpleNamespace(spec=SimpleNamespace(options=()), status="unavailable"),
            "broken": SimpleNamespace(spec=spec, status="failed"),
            "nospec": SimpleNamespace(spec=None, status="failed"),
            "twice": SimpleNamespace(spec=spec, status="conflict"),
        }
    )
    assert backend_options.declared_reads(registry, "ok") == ("tc_compiler",)
    assert backend_options.declared_reads(registry, "plain") == ()
    for name in ("broken", "nospec", "twice", "unknown"):
        assert backend_options.declared_reads(registry, name) is None, name
