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
  model (:mod:`cuda_graph_runner.reference.model`, preset ``tiny``) captured with
  ``DecodeCudaGraphRunner`` (decode and target-verify) and, for prefill backends,
  ``PrefillCudaGraphRunner`` and ``MixedCudaGraphRunner`` (two-dimensional keys: prefill
  chunks beside decodes), replays with outputs equal to eager, including padded
  batch sizes, eager fallback and recapture after ``cleanup()``, and on device index 1
  while index 0 is current (where two devices exist); a runner built with
  ``owned_outputs=True`` returns outputs that later replays leave unchanged; with the
  host-value guard on, capture succeeds and replays pass verify mode; a replay never
  runs the forward on the capture-time batch (``capture_one``'s ``forward_fn`` is bound
  to it: an eager backend that stores it and calls it at replay passes decode and fails
  prefill; replay runs ``self.capture_plan.forward(static_batch)`` instead). Where the
  backend is unavailable these tests skip with ``backend '<name>' unavailable here: <reason>``.

A standard test may only be overridden with ``@pytest.mark.xfail(reason=...)`` or
``@pytest.mark.skip(reason=...)``: ``test_no_standard_test_is_overridden_silently``
fails otherwise, so a deviation is always stated (the langchain-tests guard).

The kit is opt-in: it is not registered as a ``pytest11`` plugin, so it never loads into
unrelated pytest runs. Pin the core version you test against: a new minor version of
the kit may add tests. The ``test_device_*`` tests carry no marker; select them with
``-k test_device`` (subclasses may add marks through ``device_marks``).

The kit is a package: :mod:`.kit` (the class, discovery, spec and contract tests),
:mod:`.device_tests` (the ``test_device_*`` tests), :mod:`.packaging` (the helpers below);
import everything from ``cuda_graph_runner.testing.conformance``.

This package also holds helpers for testing plugin *packaging*: a throwaway
distribution installed into a private directory (:func:`write_plugin_source`,
:func:`install_plugin_distributions`), a fresh interpreter that sees it
(:func:`run_python`), and a picklable listing for multiprocessing children
(:func:`registry_snapshot`).
"""

from __future__ import annotations

from .device_tests import DEVICE_TESTS as _DEVICE_TESTS  # noqa: F401 - the kit's own tests read it
from .kit import BackendConformanceTests
from .packaging import install_plugin_distributions, registry_snapshot, run_python, write_plugin_source

__all__ = [
    "BackendConformanceTests",
    "install_plugin_distributions",
    "registry_snapshot",
    "run_python",
    "write_plugin_source",
]
