"""The conformance kit's class: fixtures, helpers, discovery, spec and contract tests
(the ``test_device_*`` tests come from :class:`.device_tests.DeviceConformanceTests`).
See :mod:`cuda_graph_runner.testing.conformance` for how a plugin uses it."""

from __future__ import annotations

import functools
import sys
from importlib import metadata
from typing import Any, ClassVar, Dict, Iterable, Optional, Sequence, Tuple

import pytest

from ... import registry
from ...backend.errors import BackendUnavailableError, CudaGraphRunnerError
from ...backend.hookspecs import ENTRY_POINT_GROUP, PLUGIN_API_VERSION, BackendSpec
from ...registry.discovery import load_ref, normalize_dist, ref_name
from ...registry.entries import spec_problem
from ...registry.versions import api_version_problem
from .device_tests import DEVICE_TESTS, DeviceConformanceTests
from .packaging import run_python

__all__ = ["BackendConformanceTests"]


class BackendConformanceTests(DeviceConformanceTests):
    """Base class of a backend's conformance tests; subclass it as ``Test...``.

    Class attributes to set:
        backend_name: the backend (= entry-point) name. Required.
        distribution: the distribution expected to provide it; None skips that check.

    Capability and tuning attributes (override when needed):
        device_type: device type for the device tests; None means the first of the
            spec's devices where the backend is available (``"*"``: this machine's
            accelerator, else ``"cpu"``).
        lazy_backend_import: discovery must not import the backend class's module
            (True for every backend in this repository; set False only with a reason).
        supports_target_verify: run the target-verify decode test.
        model_preset, dtype: the reference model the device tests capture.
        decode_max_bs, decode_batch_sizes: decode capture limit and the live batch sizes
            replayed (sizes off the capture buckets exercise padding).
        prefill_max_tokens, prefill_prompt_lens: prefill capture limit (tokens) and the
            prompt lengths of the replayed prefill batches.
        mixed_tokens, mixed_requests: the mixed runner's sizes per axis in the
            two-dimensional key test (a key per pair with requests <= tokens).
        atol, rtol: tolerance of graph output against eager; None (default) derives both
            from the dtype and the model's reduction sizes
            (:func:`cuda_graph_runner.testing.tolerances.model_tolerance`): graph and
            eager run at different (padded) batch shapes, so they sum in different orders.
        device_marks: pytest marks added to the ``test_device_*`` tests of a subclass
            (e.g. ``(pytest.mark.gpu,)``).
        fake_device_backend_kwargs: extra keyword arguments for the backend class in
            ``test_fake_device_calls_name_the_runners_device`` (a CPU test: the backend
            is built with ``device="cuda:1"`` and a recording fake device module whose
            current device is 0, and every stream / graph / synchronize / device-guard
            call must name device 1; see :mod:`cuda_graph_runner.testing.device_check`).
    """

    backend_name: ClassVar[str] = ""
    distribution: ClassVar[Optional[str]] = None
    device_type: ClassVar[Optional[str]] = None
    lazy_backend_import: ClassVar[bool] = True
    supports_target_verify: ClassVar[bool] = True
    model_preset: ClassVar[str] = "tiny"
    dtype: ClassVar[str] = "float32"
    decode_max_bs: ClassVar[int] = 8
    decode_batch_sizes: ClassVar[Tuple[int, ...]] = (1, 3, 6, 8)
    prefill_max_tokens: ClassVar[int] = 64
    prefill_prompt_lens: ClassVar[Tuple[Tuple[int, ...], ...]] = ((7,), (5, 9, 3), (16, 16, 16, 12))
    mixed_tokens: ClassVar[Tuple[int, ...]] = (8, 16)
    mixed_requests: ClassVar[Tuple[int, ...]] = (2, 4)
    atol: ClassVar[Optional[float]] = None
    rtol: ClassVar[Optional[float]] = None
    device_marks: ClassVar[Tuple[Any, ...]] = ()
    fake_device_backend_kwargs: ClassVar[Dict[str, Any]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.device_marks and "device_marks" in cls.__dict__:
            for name in DEVICE_TESTS:
                setattr(cls, name, _marked(getattr(cls, name), cls.device_marks))

    # -- fixtures ------------------------------------------------------------------------
    @pytest.fixture(autouse=True)
    def _conformance_fresh_registry(self) -> Iterable[None]:
        # Environment variables are read at scan time, and a test must not see another
        # test's register() calls.
        if not self.backend_name:
            pytest.fail(f"{type(self).__name__}: set the class attribute backend_name to the backend under test")
        registry.reset_registry(keep_in_process=False)
        yield
        registry.reset_registry(keep_in_process=False)

    # -- helpers -------------------------------------------------------------------------
    def entry(self) -> registry.BackendEntry:
        """The registered (unprobed) entry of the backend; fails if it is not registered."""
        reg = registry.get_registry()
        names = reg.names()
        assert self.backend_name in names, (
            f"backend {self.backend_name!r} is not registered; registered: {names}. Is its distribution installed "
            f"(pip install ...; editable installs need a reinstall after changing entry points)?"
        )
        return reg._entries[self.backend_name]

    def spec(self) -> BackendSpec:
        entry = self.entry()
        assert entry.spec is not None, f"backend {self.backend_name!r} gave no spec: {entry.reason}"
        return entry.spec

    def device_or_skip(self) -> str:
        """A device string where the backend is available, or skip with the reason it is not."""
        entry = self.entry()
        if entry.status == registry.FAILED:
            pytest.fail(f"backend {self.backend_name!r} is failed: {entry.reason}")
        if self.device_type is not None:
            candidates = [self.device_type]
        else:
            candidates = [d for d in entry.devices if d != "*"] or [registry.default_device_type()]
        reasons = []
        for device_type in candidates:
            row = {e.name: e for e in registry.list_backends(device_type)}[self.backend_name]
            if row.ok:
                return device_type
            reasons.append(f"{device_type}: {row.reason}" if len(candidates) > 1 else str(row.reason))
        pytest.skip(f"backend {self.backend_name!r} unavailable here: {'; '.join(reasons)}")

    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.dtype)

    def make_model(
        self,
        device_type: str,
        *,
        num_slots: int = 1024,
        max_reqs: int = 16,
        max_context_len: int = 64,
        attention: Optional[str] = None,
    ) -> Any:
        """The reference model with an attached KV cache on ``device_type`` (``attention``:
        its attention backend's name, None: ``torch``)."""
        from ...reference.model import ReferenceLlamaForCausalLM

        model = ReferenceLlamaForCausalLM.from_preset(
            self.model_preset, dtype=self.torch_dtype(), device=device_type, attention=attention
        )
        model.create_kv_cache(num_slots=num_slots, max_reqs=max_reqs, max_context_len=max_context_len)
        return model

    def tolerance(self) -> Dict[str, float]:
        """``{"atol", "rtol"}`` of :meth:`assert_close`: the class attributes where set, else
        derived from ``dtype`` and ``model_preset``."""
        from ...reference.model import PRESETS
        from ..tolerances import model_tolerance

        derived = model_tolerance(PRESETS[self.model_preset], self.dtype, context_len=64)
        return {
            "atol": derived["atol"] if self.atol is None else self.atol,
            "rtol": derived["rtol"] if self.rtol is None else self.rtol,
        }

    def assert_close(self, got: Any, expected: Any, what: str) -> None:
        """Floating-point leaves within :meth:`tolerance`; integer and bool leaves (token
        ids) exactly, as ``torch.testing.assert_close`` would apply the tolerance to them too.

        Raises:
            AssertionError: a leaf differs (torch's message, prefixed with the backend and ``what``).
        """
        import torch

        from ...backend.nested import iter_tensors
        from ...runner.verify import compared_exactly

        tol = self.tolerance()

        def msg(m: str) -> str:
            return f"backend {self.backend_name!r}, {what}: graph output differs from eager\n{m}"

        torch.testing.assert_close(got, expected, atol=tol["atol"], rtol=tol["rtol"], msg=msg)
        for (_, a), (_, b) in zip(iter_tensors(got, where=""), iter_tensors(expected, where="")):
            if compared_exactly(a):
                torch.testing.assert_close(a, b, atol=0, rtol=0, msg=msg)

    # -- discovery ----------------------------------------------------------------------
    def test_entry_point_is_installed(self) -> None:
        eps = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == self.backend_name]
        assert eps, (
            f"no entry point {self.backend_name!r} in group {ENTRY_POINT_GROUP!r}; declare it in pyproject.toml "
            f'under [project.entry-points."{ENTRY_POINT_GROUP}"] and reinstall the distribution'
        )
        dists = sorted({ep.dist.name if ep.dist is not None else "?" for ep in eps})
        assert len(dists) == 1, f"backend name {self.backend_name!r} is registered by several distributions: {dists}"
        if self.distribution is not None:
            assert normalize_dist(dists[0]) == normalize_dist(self.distribution), (
                f"entry point {self.backend_name!r} comes from {dists[0]}, expected {self.distribution}"
            )

    def test_listed_with_distribution_and_version(self) -> None:
        rows = {e.name: e for e in registry.list_backends()}
        assert self.backend_name in rows, f"list_backends() lacks {self.backend_name!r}: {sorted(rows)}"
        row = rows[self.backend_name]
        assert row.status != registry.FAILED, f"backend {self.backend_name!r} is failed: {row.reason}"
        ep = next(ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == self.backend_name)
        assert ep.dist is not None and row.distribution == ep.dist.name and row.version == ep.dist.version, (
            f"listed as {row.distribution} {row.version}, installed as {ep.dist and ep.dist.name} "
            f"{ep.dist and ep.dist.version}"
        )
        if row.status == registry.UNAVAILABLE:
            assert row.reason, f"backend {self.backend_name!r} is unavailable without a reason"

    def test_listing_does_not_import_backend_class(self) -> None:
        if not self.lazy_backend_import:
            pytest.skip("lazy_backend_import = False: this backend's registration module imports its class")
        ref = self.spec().backend_class
        assert isinstance(ref, str), "backend_class must be a 'module:Class' string so discovery stays lazy"
        module = ref.partition(":")[0]
        report = run_python(
            f"""
            import json, sys
            from cuda_graph_runner import registry
            rows = {{e.name: e.status for e in registry.list_backends()}}
            print(json.dumps({{"rows": rows, "imported": {module!r} in sys.modules}}))
        """,
            pythonpath=sys.path,
        )
        assert self.backend_name in report["rows"], f"a fresh process does not list {self.backend_name!r}: {report}"
        assert not report["imported"], (
            f"listing backends imported {module!r}; the entry point must name a light registration module "
            f"that refers to the class as a string"
        )

    # -- the spec and the contract ---------------------------------------------------------
    def test_spec_is_well_formed_and_declares_api_version(self) -> None:
        spec = self.spec()
        assert spec.name == self.backend_name, f"spec name {spec.name!r} differs from the entry-point name"
        assert spec_problem(spec) is None, spec_problem(spec)
        assert spec.api_version is not None, (
            f"backend {self.backend_name!r} does not declare api_version; write the plugin API version it was "
            f"written for as a literal, e.g. BackendSpec(..., api_version={PLUGIN_API_VERSION!r})"
        )
        problem = api_version_problem(spec.api_version)
        assert problem is None, f"backend {self.backend_name!r} {problem}"
        assert spec.description, "give the spec a one-line description (cuda-graph-runner backends shows it)"

    def test_backend_class_honours_contract(self) -> None:
        row = registry.verify(self.backend_name)
        if row.contract.startswith("not checked"):
            pytest.skip(f"backend {self.backend_name!r}: {row.contract} (unavailable here: {row.reason})")
        assert row.contract == "ok", f"backend {self.backend_name!r}: {row.reason}"
        cls = registry.get_registry().load_class(row)
        registry.check_backend_class(cls, self.backend_name)  # raises, naming the problem
        again = {e.name: e for e in registry.list_backends()}[self.backend_name]
        assert again.contract == "ok" and again.status != registry.FAILED, again.reason

    def test_probe_answers_for_every_device_type(self) -> None:
        spec = self.spec()
        if spec.probe is None:
            return
        probe = load_ref(spec.probe)
        for device_type in sorted({d for d in spec.devices if d != "*"} | {"cpu", "cuda", "npu", "xpu"}):
            answer = probe(device_type)  # must not raise
            assert answer is None or answer is True or (isinstance(answer, str) and answer.strip()), (
                f"probe {ref_name(spec.probe)}({device_type!r}) returned {answer!r}; "
                "return None (or True) or a non-empty reason"
            )

    def test_default_backend_hook_names_a_usable_backend(self) -> None:
        reg = registry.get_registry()
        for phase in registry.PHASES:
            for device_type in ("cpu", "cuda", "npu"):
                name = reg.default_backend(phase, device_type)
                row = {e.name: e for e in reg.entries(device_type)}[name]
                assert row.ok and phase in row.phases, f"default {phase} backend on {device_type} is {name!r}: {row}"
        row = reg._entries[self.backend_name]
        assert row.status != registry.FAILED, f"a default-backend hook failed: {row.reason}"

    def test_selected_by_config_string(self) -> None:
        from ...config import CudaGraphConfig

        spec = self.spec()
        phase = spec.phases[0]
        config = CudaGraphConfig.from_dict({phase: {"backend": self.backend_name}})
        config.validate(registry.backend_phases())
        device_type = self.device_type or next((d for d in spec.devices if d != "*"), registry.default_device_type())
        row = {e.name: e for e in registry.list_backends(device_type)}[self.backend_name]
        if not row.ok:
            with pytest.raises(BackendUnavailableError) as info:
                registry.get_registry().resolve(phase, config, device=device_type)
            assert str(row.reason) in str(info.value), (
                f"the error does not give the reason {row.reason!r}: {info.value}"
            )
            return
        backend = registry.get_registry().resolve(phase, config, device=device_type)
        cls = registry.get_registry().load_class(row)
        assert type(backend) is cls and backend.phase == phase
        assert backend.name == self.backend_name

    def test_unsupported_phase_is_refused_by_name(self) -> None:
        spec = self.spec()
        other = [p for p in registry.PHASES if p not in spec.phases]
        if not other:
            return
        device_type = self.device_type or next((d for d in spec.devices if d != "*"), registry.default_device_type())
        with pytest.raises(CudaGraphRunnerError) as info:
            registry.get_registry().resolve(other[0], self.backend_name, device=device_type)
        assert self.backend_name in str(info.value)

    def test_no_standard_test_is_overridden_silently(self) -> None:
        silent = []
        standard: Dict[str, Any] = {}
        for klass in reversed(BackendConformanceTests.__mro__):  # the kit's classes, base first
            standard.update(vars(klass))
        for name, base_fn in standard.items():
            if not name.startswith("test_"):
                continue
            fn = getattr(type(self), name)
            if fn is base_fn or getattr(fn, "_conformance_wrapped", None) is base_fn:
                continue
            marks = [m for m in getattr(fn, "pytestmark", []) if m.name in ("xfail", "skip")]
            if not any(m.kwargs.get("reason") or m.args for m in marks):
                silent.append(name)
        assert not silent, (
            f"{type(self).__name__} overrides standard test(s) {silent} without "
            "@pytest.mark.xfail(reason=...) or @pytest.mark.skip(reason=...)"
        )

    def test_fake_device_calls_name_the_runners_device(self) -> None:
        """On the CPU: the backend on fake ``cuda:1`` while device 0 is current acts on 1 only."""
        self._require_phase("decode")
        from ...config import PhaseConfig
        from ..device_check import check_device_calls

        row = {e.name: e for e in registry.list_backends()}[self.backend_name]
        try:
            cls = registry.get_registry().load_class(row)
        except Exception as exc:  # unloadable here: the contract test reports it
            pytest.skip(f"backend {self.backend_name!r} cannot be loaded here: {exc}")
        phase_config = PhaseConfig(backend=self.backend_name, max_bs=4)

        def make(device: str, module: Any) -> Any:
            return cls(
                device,
                phase="decode",
                phase_config=phase_config,
                device_module=module,
                **self.fake_device_backend_kwargs,
            )

        try:
            check_device_calls(make)
        except BackendUnavailableError as exc:
            pytest.skip(f"backend {self.backend_name!r} cannot run on the fake device module: {exc}")

    def _require_phase(self, phase: str) -> None:
        phases = self.entry().phases
        if phase not in phases:
            pytest.skip(f"backend {self.backend_name!r} declares phases {list(phases)}, not {phase!r}")


def _marked(fn: Any, marks: Sequence[Any]) -> Any:
    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(self, *args, **kwargs)

    wrapper._conformance_wrapped = getattr(fn, "_conformance_wrapped", fn)  # type: ignore[attr-defined]
    for mark in marks:
        wrapper = mark(wrapper)
    return wrapper
