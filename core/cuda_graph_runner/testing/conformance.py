"""Conformance kit: the tests every backend, ours or a vendor's, must pass.

A plugin author subclasses :class:`BackendConformanceTests` in a ``test_*.py`` module of
the plugin's own test suite and names the backend::

    from cuda_graph_runner.testing.conformance import BackendConformanceTests

    class TestAcmeConformance(BackendConformanceTests):
        backend_name = "acme"
        distribution = "cuda-graph-runner-acme"   # optional: the wheel that must provide it

then runs ``pytest`` in an environment where the plugin is *installed* (from its wheel,
or editable). What is checked:

* **discovery**: the backend is found through its installed entry point, listed with
  its distribution and version, and listing does not import the backend class;
* **the spec**: a config-spellable name equal to the entry-point name, valid phases and
  devices, a lazy ``"module:Class"`` reference, an explicitly declared plugin API
  version compatible with this core;
* **the contract**: the class subclasses ``BaseCudaGraphBackend``, implements every
  abstract method and accepts the arguments the runners pass
  (:func:`cuda_graph_runner.registry.check_backend_class`); probes and hooks answer for
  every device type without raising; a config string selects it, and an unusable
  backend or phase is refused with its reason;
* **on a device where the backend is available** (``test_device_*``): the reference
  model (:mod:`cuda_graph_runner.testing.model`, preset ``tiny``) captured with
  ``DecodeCudaGraphRunner`` (decode and target-verify) and, for prefill backends,
  ``PrefillCudaGraphRunner``, replays with outputs equal to eager, including padded
  batch sizes, eager fallback and recapture after ``cleanup()``, and on device index 1
  while index 0 is current (where two devices exist); a runner built with
  ``owned_outputs=True`` returns outputs that later replays leave unchanged; with the
  host-value guard on, capture succeeds and replays pass verify mode. Where the backend is
  unavailable these tests skip with ``backend '<name>' unavailable here: <reason>``.

A standard test may only be overridden with ``@pytest.mark.xfail(reason=...)`` or
``@pytest.mark.skip(reason=...)``: ``test_no_standard_test_is_overridden_silently``
fails otherwise, so a deviation is always stated (the langchain-tests guard).

The kit is opt-in: it is not registered as a ``pytest11`` plugin, so it never loads into
unrelated pytest runs. Pin the core version you test against: a new minor version of
the kit may add tests. The ``test_device_*`` tests carry no marker; select them with
``-k test_device`` (subclasses may add marks through ``device_marks``).

This module also holds helpers for testing plugin *packaging*: a throwaway
distribution installed into a private directory (:func:`write_plugin_source`,
:func:`install_plugin_distributions`), a fresh interpreter that sees it
(:func:`run_python`), and a picklable listing for multiprocessing children
(:func:`registry_snapshot`).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import pytest

from .. import registry
from ..errors import BackendUnavailableError, CudaGraphRunnerError
from ..hookspecs import ENTRY_POINT_GROUP, PLUGIN_API_VERSION, BackendSpec

__all__ = [
    "BackendConformanceTests",
    "install_plugin_distributions",
    "registry_snapshot",
    "run_python",
    "write_plugin_source",
]

_DEVICE_TESTS = (
    "test_device_decode_capture_replay_matches_eager",
    "test_device_target_verify_matches_eager",
    "test_device_prefill_capture_replay_matches_eager",
    "test_device_cleanup_then_recapture",
    "test_device_runner_on_second_device_matches_eager",
    "test_device_owned_outputs_survive_later_replays",
    "test_device_reference_model_passes_verify_mode",
)


class BackendConformanceTests:
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
    atol: ClassVar[Optional[float]] = None
    rtol: ClassVar[Optional[float]] = None
    device_marks: ClassVar[Tuple[Any, ...]] = ()
    fake_device_backend_kwargs: ClassVar[Dict[str, Any]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.device_marks and "device_marks" in cls.__dict__:
            for name in _DEVICE_TESTS:
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
        self, device_type: str, *, num_slots: int = 1024, max_reqs: int = 16, max_context_len: int = 64
    ) -> Any:
        """The reference model with an attached KV cache on ``device_type``."""
        from .model import ReferenceLlamaForCausalLM

        model = ReferenceLlamaForCausalLM.from_preset(self.model_preset, dtype=self.torch_dtype(), device=device_type)
        model.create_kv_cache(num_slots=num_slots, max_reqs=max_reqs, max_context_len=max_context_len)
        return model

    def tolerance(self) -> Dict[str, float]:
        """``{"atol", "rtol"}`` of :meth:`assert_close`: the class attributes where set, else
        derived from ``dtype`` and ``model_preset``."""
        from .model import PRESETS
        from .tolerances import model_tolerance

        derived = model_tolerance(PRESETS[self.model_preset], self.dtype, context_len=64)
        return {
            "atol": derived["atol"] if self.atol is None else self.atol,
            "rtol": derived["rtol"] if self.rtol is None else self.rtol,
        }

    def assert_close(self, got: Any, expected: Any, what: str) -> None:
        import torch

        torch.testing.assert_close(
            got,
            expected,
            **self.tolerance(),  # type: ignore[arg-type]  # atol/rtol floats, not assert_close's bools
            msg=lambda m: f"backend {self.backend_name!r}, {what}: graph output differs from eager\n{m}",
        )

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
            assert registry._normalize_dist(dists[0]) == registry._normalize_dist(self.distribution), (
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
        assert registry._spec_problem(spec) is None, registry._spec_problem(spec)
        assert spec.api_version is not None, (
            f"backend {self.backend_name!r} does not declare api_version; write the plugin API version it was "
            f"written for as a literal, e.g. BackendSpec(..., api_version={PLUGIN_API_VERSION!r})"
        )
        problem = registry.api_version_problem(spec.api_version)
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
        probe = registry._load_ref(spec.probe)
        for device_type in sorted({d for d in spec.devices if d != "*"} | {"cpu", "cuda", "npu", "xpu"}):
            answer = probe(device_type)  # must not raise
            assert answer is None or (isinstance(answer, str) and answer.strip()), (
                f"probe {spec.probe}({device_type!r}) returned {answer!r}; return None or a non-empty reason"
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
        from ..config import CudaGraphConfig

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
        for name, base_fn in vars(BackendConformanceTests).items():
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
        from ..config import PhaseConfig
        from .device_check import check_device_calls

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

    # -- on the device -----------------------------------------------------------------------
    def test_device_decode_capture_replay_matches_eager(self) -> None:
        self._require_phase("decode")
        device_type = self.device_or_skip()
        import torch

        from ..runner import DecodeCudaGraphRunner
        from .batches import GreedySession, eager_logits_fn, make_decode_batch, make_dummy_prompts

        model = self.make_model(device_type)
        cache = model.kv_cache
        runner = DecodeCudaGraphRunner(
            model, {"decode": {"backend": self.backend_name, "max_bs": self.decode_max_bs}}, show_progress=False
        )
        assert runner.backend.name == self.backend_name
        with torch.no_grad():
            runner.capture()
            assert runner.captured_keys, "capture() recorded no shape"
            eager = eager_logits_fn(model)
            for bs in self.decode_batch_sizes:
                session = GreedySession(model, cache)
                session.prefill(
                    make_dummy_prompts(bs, [3 + i % 4 for i in range(bs)], model.config.vocab_size, seed=bs)
                )
                session.decode()  # requests of different lengths
                batch = make_decode_batch(cache, session.rows, None, [t[-1] for t in session.tokens])
                expected = eager(batch).clone()
                if bs <= self.decode_max_bs:
                    assert runner.can_run(batch), f"batch size {bs} <= max_bs {self.decode_max_bs} cannot replay"
                got = runner.forward(batch).clone()
                assert got.shape == expected.shape, (
                    f"batch size {bs}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
                )
                self.assert_close(got, expected, f"decode batch size {bs}")
                session.close()
            runner.cleanup()

    def test_device_target_verify_matches_eager(self) -> None:
        self._require_phase("decode")
        if not self.supports_target_verify:
            pytest.skip(f"backend {self.backend_name!r} declares supports_target_verify = False")
        device_type = self.device_or_skip()
        import torch

        from ..forward_batch import ForwardMode
        from ..runner import DecodeCudaGraphRunner
        from .batches import eager_logits_fn, make_dummy_prompts, make_extend_batch, make_target_verify_batch

        width = 3
        model = self.make_model(device_type)
        cache = model.kv_cache
        runner = DecodeCudaGraphRunner(
            model,
            {"decode": {"backend": self.backend_name, "max_bs": 4}},
            mode=ForwardMode.TARGET_VERIFY,
            num_tokens_per_req=width,
            show_progress=False,
        )
        eager = eager_logits_fn(model)
        with torch.no_grad():
            runner.capture()
            for bs in (1, 3):
                prefill = make_extend_batch(cache, make_dummy_prompts(bs, 5, model.config.vocab_size, seed=10 + bs))
                eager(prefill)
                rows = prefill.req_pool_indices.tolist()
                batch = make_target_verify_batch(
                    cache, rows, make_dummy_prompts(bs, width, model.config.vocab_size, seed=bs)
                )
                expected = eager(batch).clone()
                assert runner.can_run(batch), f"target-verify batch size {bs} cannot replay"
                got = runner.forward(batch).clone()
                self.assert_close(got, expected, f"target-verify batch size {bs} width {width}")
                for r in rows:
                    cache.free_request(r)
            runner.cleanup()

    def test_device_prefill_capture_replay_matches_eager(self) -> None:
        self._require_phase("prefill")
        device_type = self.device_or_skip()
        import torch

        try:
            from ..runner import PrefillCudaGraphRunner
        except ImportError as exc:  # an older core
            pytest.skip(f"this core has no PrefillCudaGraphRunner: {exc}")
        from .batches import eager_logits_fn, make_dummy_prompts, make_extend_batch

        model = self.make_model(device_type)
        cache = model.kv_cache
        runner = PrefillCudaGraphRunner(
            model, {"prefill": {"backend": self.backend_name, "max_bs": self.prefill_max_tokens}}, show_progress=False
        )
        assert runner.backend.name == self.backend_name
        eager = eager_logits_fn(model)
        with torch.no_grad():
            runner.capture()
            replayed = 0
            for i, lens in enumerate(self.prefill_prompt_lens):
                prompts = make_dummy_prompts(len(lens), list(lens), model.config.vocab_size, seed=20 + i)
                first = make_extend_batch(cache, [p[: max(1, len(p) // 2)] for p in prompts])
                rows = first.req_pool_indices.tolist()
                # Two chunks: the second has cached prefixes (chunked prefill).
                second = make_extend_batch(cache, [p[max(1, len(p) // 2) :] or [p[-1]] for p in prompts], rows=rows)
                for which, batch in (("first chunk", first), ("second chunk", second)):
                    expected = eager(batch).clone()
                    replayed += runner.can_run(batch)
                    got = runner.forward(batch).clone()
                    assert got.shape == expected.shape
                    self.assert_close(got, expected, f"prefill {which} of prompt lengths {list(lens)}")
                for r in rows:
                    cache.free_request(r)
            assert replayed, "no prefill batch replayed a graph (every batch fell back to eager)"
            runner.cleanup()

    def test_device_cleanup_then_recapture(self) -> None:
        self._require_phase("decode")
        device_type = self.device_or_skip()
        import torch

        from ..runner import DecodeCudaGraphRunner
        from .batches import GreedySession, eager_logits_fn, make_decode_batch, make_dummy_prompts

        model = self.make_model(device_type)
        cache = model.kv_cache
        runner = DecodeCudaGraphRunner(
            model, {"decode": {"backend": self.backend_name, "max_bs": 4}}, show_progress=False
        )
        with torch.no_grad():
            for round_ in range(2):
                runner.capture()
                session = GreedySession(model, cache)
                session.prefill(make_dummy_prompts(3, 4, model.config.vocab_size, seed=round_))
                batch = make_decode_batch(cache, session.rows, None, [t[-1] for t in session.tokens])
                expected = eager_logits_fn(model)(batch).clone()
                assert runner.can_run(batch), f"round {round_}: a captured size cannot replay"
                self.assert_close(runner.forward(batch).clone(), expected, f"capture round {round_}")
                session.close()
                runner.cleanup()
                assert not runner.can_run(batch), "after cleanup() the runner still claims a graph"

    def test_device_runner_on_second_device_matches_eager(self) -> None:
        """A runner on device index 1 while index 0 is current replays equal to eager,
        and no graph comes out empty (torch's "captured on wrong device or stream")."""
        self._require_phase("decode")
        device_type = self.device_or_skip()
        import warnings

        import torch

        from ..runner import DecodeCudaGraphRunner
        from .batches import GreedySession, eager_logits_fn, make_decode_batch, make_dummy_prompts

        module = torch.get_device_module(device_type)
        count = module.device_count() if device_type != "cpu" and hasattr(module, "device_count") else 1
        if count < 2:
            pytest.skip(
                f"needs 2 {device_type} devices (a runner on {device_type}:1 while {device_type}:0 is "
                f"current); this machine has {count}"
            )
        module.set_device(0)
        model = self.make_model(f"{device_type}:1")
        cache = model.kv_cache
        runner = DecodeCudaGraphRunner(
            model, {"decode": {"backend": self.backend_name, "max_bs": self.decode_max_bs}}, show_progress=False
        )
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runner.capture()
            session = GreedySession(model, cache)
            bs = min(5, self.decode_max_bs)
            session.prefill(make_dummy_prompts(bs, [3 + i for i in range(bs)], model.config.vocab_size, seed=7))
            batch = make_decode_batch(cache, session.rows, None, [t[-1] for t in session.tokens])
            expected = eager_logits_fn(model)(batch).clone()
            assert runner.can_run(batch), f"batch size {bs} cannot replay on {device_type}:1"
            got = runner.forward(batch).clone()
            session.close()
            runner.cleanup()
        empty = [str(w.message) for w in caught if "graph is empty" in str(w.message).lower()]
        assert not empty, f"a graph was captured on the wrong device or stream: {empty}"
        assert module.current_device() == 0, "the runner left another device current"
        self.assert_close(got, expected, f"decode batch size {bs} on {device_type}:1")

    def test_device_owned_outputs_survive_later_replays(self) -> None:
        """The output-lifetime contract's option: with ``owned_outputs=True`` an output kept
        from one replay is unchanged by replays of the same and of another size."""
        self._require_phase("decode")
        device_type = self.device_or_skip()
        import torch

        from ..runner import DecodeCudaGraphRunner
        from .batches import GreedySession, eager_logits_fn, make_decode_batch, make_dummy_prompts

        model = self.make_model(device_type)
        cache = model.kv_cache
        runner = DecodeCudaGraphRunner(
            model,
            {"decode": {"backend": self.backend_name, "max_bs": self.decode_max_bs}},
            owned_outputs=True,
            show_progress=False,
        )
        eager = eager_logits_fn(model)
        sizes = (min(3, self.decode_max_bs), self.decode_max_bs)
        with torch.no_grad():
            runner.capture()
            kept, expected = [], []
            for i, bs in enumerate(sizes + sizes):
                session = GreedySession(model, cache)
                session.prefill(make_dummy_prompts(bs, 3 + i, model.config.vocab_size, seed=40 + i))
                batch = make_decode_batch(cache, session.rows, None, [t[-1] for t in session.tokens])
                expected.append(eager(batch).clone())
                assert runner.can_run(batch), f"batch size {bs} <= max_bs {self.decode_max_bs} cannot replay"
                kept.append(runner.forward(batch))  # kept without a copy: the runner owns it for us
                session.close()  # the kept output needs no cache rows
            for i, (got, want) in enumerate(zip(kept, expected)):
                self.assert_close(got, want, f"owned output {i} (batch size {(sizes + sizes)[i]}) after later replays")
            runner.cleanup()

    def test_device_reference_model_passes_verify_mode(self) -> None:
        """Captured with the host-value guard on, the reference model's decode replays pass
        verify mode (every replay checked against the backend's own reference and tolerance)."""
        self._require_phase("decode")
        device_type = self.device_or_skip()
        import torch

        from ..runner import DecodeCudaGraphRunner
        from .batches import GreedySession, make_dummy_prompts

        model = self.make_model(device_type)
        config = {"decode": {"backend": self.backend_name, "max_bs": 4, "verify": True, "verify_every": 1}}
        runner = DecodeCudaGraphRunner(model, config, show_progress=False)
        with torch.no_grad():
            runner.capture()
            session = GreedySession(model, model.kv_cache, decode_fn=runner.forward)
            session.prefill(make_dummy_prompts(3, [3, 5, 4], model.config.vocab_size, seed=11))
            for _ in range(3):
                session.decode()
            session.close()
            runner.cleanup()
        assert runner.verifier is not None and len(runner.verifier.checked) == 3, "replays were not verified"

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


# --------------------------------------------------------------------------- packaging helpers


def registry_snapshot(device_type: Optional[str] = "cpu") -> List[Dict[str, str]]:
    """``list_backends(device_type)`` as plain rows (``BackendEntry.as_row``), plus the
    process id: picklable, so a multiprocessing child can report what it discovered."""
    return [dict(e.as_row(), pid=str(os.getpid())) for e in registry.list_backends(device_type)]


def write_plugin_source(
    directory: Path,
    dist_name: str,
    modules: Mapping[str, str],
    entry_points: Mapping[str, str],
    *,
    version: str = "0.0.1",
) -> Path:
    """Write a minimal plugin distribution (one-file modules) to ``directory``.

    Args:
        dist_name: distribution name (``"acme-broken"``).
        modules: ``{module_name: source}``; sources are dedented.
        entry_points: ``{backend_name: "module[:attr]"}`` in group ``cuda_graph_runner.backends``.

    Returns:
        ``directory``, ready for ``pip install``.
    """
    directory.mkdir(parents=True, exist_ok=True)
    for name, source in modules.items():
        (directory / f"{name}.py").write_text(textwrap.dedent(source))
    eps = "\n".join(f'{name} = "{value}"' for name, value in entry_points.items())
    (directory / "pyproject.toml").write_text(
        "[build-system]\n"
        'requires = ["setuptools>=68"]\n'
        'build-backend = "setuptools.build_meta"\n'
        "[project]\n"
        f'name = "{dist_name}"\n'
        f'version = "{version}"\n'
        f'[project.entry-points."{ENTRY_POINT_GROUP}"]\n'
        f"{eps}\n"
        "[tool.setuptools]\n"
        f"py-modules = {json.dumps(sorted(modules))}\n"
    )
    return directory


def install_plugin_distributions(site: Path, *sources: Path) -> Path:
    """``pip install`` plugin source trees into the private directory ``site`` (``--target``),
    offline and without build isolation; put ``site`` on ``PYTHONPATH`` to see them.

    Raises:
        subprocess.CalledProcessError: pip failed (its output is in the exception).
    """
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(site),
            *map(str, sources),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return site


def run_python(
    code: str, *, pythonpath: Sequence[Any] = (), env: Optional[Mapping[str, str]] = None, expect_ok: bool = True
) -> Dict[str, Any]:
    """Run ``code`` in a fresh interpreter; return the JSON object on its last stdout line.

    Args:
        pythonpath: directories prepended to ``PYTHONPATH``.
        env: extra environment variables (a value of ``None`` is not allowed; to unset
            use an empty string where the variable allows it).
        expect_ok: assert a zero exit status. When False, returns ``{"returncode",
            "stdout", "stderr"}`` and never parses.
    """
    full_env = dict(os.environ)
    full_env.update(env or {})
    paths = [str(p) for p in pythonpath if p]
    if paths:
        full_env["PYTHONPATH"] = os.pathsep.join(
            paths + ([full_env["PYTHONPATH"]] if full_env.get("PYTHONPATH") else [])
        )
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True, text=True)
    if not expect_ok:
        return {"returncode": out.returncode, "stdout": out.stdout, "stderr": out.stderr}
    assert out.returncode == 0, f"subprocess failed ({out.returncode}):\n{out.stderr[-4000:]}"
    lines = out.stdout.strip().splitlines()
    assert lines, f"subprocess printed nothing; stderr:\n{out.stderr[-4000:]}"
    return json.loads(lines[-1])
