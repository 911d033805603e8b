"""CUDA-graph configuration for the decode and prefill phases.

Standard library only: this module never imports torch, so launchers and the
CLI can parse and validate a config before touching a device.

The model
---------
A :class:`CudaGraphConfig` holds one :class:`PhaseConfig` per phase
(``decode``, ``prefill``). Each phase has these keys:

``backend``
    Name of the capture backend, or ``None`` for *auto* (the registry picks the
    device default: ``full`` for decode and ``breakable`` for prefill on CUDA,
    ``disabled`` on CPU). Names are open: ``full``, ``breakable``,
    ``tc_piecewise``, ``npu`` and ``disabled`` are well known, and any installed
    plugin adds its own. Whether a name is installed, and allowed for the phase,
    is checked by :meth:`CudaGraphConfig.validate` against the registry.
``max_bs``
    Decode: the largest batch size; prefill: the largest token count.
    ``None``: the runner's default (``DEFAULT_MAX_BS``: 256 decode, 4096 prefill).
    The default buckets are cut at it; decode captures ``max_bs`` itself too, prefill
    stops at the last bucket (sglang: 5000 captures up to 4608).
    At most ``MAX_CAPTURE_SIZE`` (65,536: far above any engine's batch; a larger
    value would only build millions of capture sizes and gigabytes of buffers).
``bs``
    Explicit capture sizes, captured as given (``max_bs`` is then ignored: sglang makes
    it max(bs)); ``None``: the runner's default buckets. Lists are
    normalised: sorted ascending, duplicates dropped. Each size is at most
    ``MAX_CAPTURE_SIZE``.
``tc_compiler``
    ``eager`` or ``inductor``: tc_piecewise's compiler of its pieces (sglang's
    meaning); a *backend option* (``BACKEND_OPTION_KEYS``): read only by backends
    whose spec lists it in ``BackendSpec.options``. Setting an option that the selected
    backend does not read is an error at resolve time (see
    ``cuda_graph_runner.backend.options``), except ``tc_compiler`` from sglang's own
    spellings (``--cuda-graph-tc-compiler``, ``--piecewise-cuda-graph-compiler``,
    ``--cuda-graph-config``), ignored with a warning as sglang ignores it. Decode
    ``tc_compiler`` with backend ``full`` (or auto) from any other source is the
    deprecated spelling of ``torch_compile``: rewritten to it, with a
    ``DeprecationWarning``.
``torch_compile``
    ``false`` (default), ``true`` or a compiler name (``inductor``; true means it): the
    phase's forward compiled before ``full`` captures it (compiled full; sglang's
    ``--enable-torch-compile``). Read by ``full``.
``torch_compile_max_bs``
    ``null`` (sglang's default, 32) or the largest size captured from the compiled
    forward; larger sizes capture the forward as written (sglang's
    ``--torch-compile-max-bs``). Counts as set only with ``torch_compile`` on.
``compile_sizes``
    ``null`` (default: one dynamic-shape compiled graph serves every size) or a list
    of captured sizes that each get a graph compiled with static shapes (vLLM's
    ``compile_sizes``): inductor specializes its kernels to the size, a few percent
    faster per step for seconds of compile time per size. A backend option (read by
    ``full``). With ``torch_compile`` off it is an error for a backend that reads
    both (nothing would compile), as is a size above ``torch_compile_max_bs``, from ``cuda-graph-runner config`` and at resolve
    time; a size that is not captured, when the backend prepares its capture.
``owned_outputs``
    ``false`` (default, zero-copy: a replayed output is valid until the next replay
    of any graph in the same pool) or ``true`` (the runner returns owned copies, one
    copy per replay). Read by the runner, for every backend.
``host_value_guard``
    ``true`` (default): model code reading a host value of the batch
    (``seq_lens_cpu``, ...) where the graph would freeze it is an error at capture
    (``cuda_graph_runner.backend.host_guard``); ``false`` turns the check off.
``verify``, ``verify_first_n``, ``verify_every``
    Verify mode (``cuda_graph_runner.runner.verify``), off by default: compare the first
    ``verify_first_n`` replays of each shape (default 3), and every
    ``verify_every``-th one (0, the default: none after those), with the backend's
    reference on the same batch. The environment variables
    ``CUDA_GRAPH_RUNNER_VERIFY``, ``CUDA_GRAPH_RUNNER_VERIFY_FIRST_N`` and
    ``CUDA_GRAPH_RUNNER_VERIFY_EVERY`` override these for both phases.
``warmup``
    How many forward runs precede each captured size (``WARMUP_POLICIES``; read by
    the base backend's warm-up, so by every backend that uses it):
    ``auto`` (default) warms the first size of a capture session up the backend's
    ``num_warmups`` times (sglang: twice) and each later size once, or not at all when
    the backend already ran that size's kernels (tc_piecewise's compile pass);
    ``every_size`` warms every size up ``num_warmups`` times (sglang's policy, the
    slowest); ``first_size`` warms only the first size up (for models without per-shape
    JIT compilation, autotuning or lazy allocations: the fastest capture).
``variants``
    Graph variants captured per size (``cuda_graph_runner.runner.variants``; decode
    runner): ``null`` (default) captures every variant the model declares
    (``model.graph_variants()``; none: one graph per size); a list such as
    ``["nolora", "lora"]`` captures those, in that order, each for every size
    (capture count = sizes x variants; capture time and graph memory grow with it). A
    batch whose variant was not captured runs eagerly (fallback reason
    ``"variant not captured"``). Labels are letters, digits and ``_``; a label the
    model does not declare is an error when the runner is built.
``padded_eager``
    ``false`` (default): an eager forward (backend ``disabled``, a fallback, verify
    mode's reference) runs the live batch as it is. ``true``: a batch that a captured
    size covers runs eagerly padded to that size (the padded batch a replay would see),
    its outputs cut back to the live rows, so replay and eager run the same shapes and,
    with an attention whose eager and captured paths run the same kernels, give
    bitwise-equal outputs in every dtype (bf16 GEMMs pick their kernels by shape).
    Costs the padded rows' compute on every eager step (decode: up to the next bucket,
    e.g. 13 requests run as 16). A batch no replay would take either (larger than the
    largest size; prefill: padded to more than twice its tokens) runs as it is. Read by
    the runner (``cuda_graph_runner.runner.padded_eager``), for every backend.
``eager_through``
    ``false`` (default) or ``true``: eager-through mode
    (``cuda_graph_runner.runner.eager_through``): every replay pads the batch and fills
    the static buffers as ever, but runs the forward eagerly on the static batch instead
    of replaying the graph. With ``verify`` it tells a graph bug from a padding bug. The
    environment variable ``CUDA_GRAPH_RUNNER_EAGER_THROUGH`` overrides it for both phases.
``full_prefill_max_req``
    Prefill only (sglang's key of the same name): the request slots of each prefill
    ``full`` graph. A batch's requests are padded to this count with zero-length
    sentinel requests; a batch of more requests runs eagerly (fallback reason
    ``"more requests than slots"``). ``null`` (default): ``max(1, max_tokens // 512)``
    for the largest captured token count, as sglang derives it. Other prefill backends
    ignore it (their attention runs eagerly on the live requests).
``mixed_tokens``, ``mixed_requests``
    Prefill only: the sizes per axis of the mixed runner's two-dimensional keys
    (``cuda_graph_runner.runner.mixed``: a batch of prefill chunks and decodes keyed by
    requests x tokens). Each a non-empty list of integers from 1 to 65536, stored sorted
    without duplicates; a key is captured for every pair with requests <= tokens.
    ``null`` (default): tokens ``[64, 128, 256, 512]``, requests ``[1, 2, 4, 8, 16,
    32]``. A request list whose smallest count exceeds the largest token count is an
    error. The mixed runner reads the prefill phase's backend and options; the prefill
    runner ignores these keys.
``check_weights_every``
    ``0`` (default: off, nothing on the replay path) or N: every N-th replay of
    ``forward`` first checks that the model's parameters and buffers still live where
    the graphs read them (``runner.check_weights()``, ``cuda_graph_runner.runner.weights``) and
    raises ``StaleWeightsError`` naming the moved ones. Up to N-1 replays after a
    re-assignment can run before the check sees it; call ``check_weights()`` after
    loading weights to be exact.
``forward_asleep``
    What ``forward`` does while the runner sleeps (``runner.sleep()``, graph memory
    given back): ``eager`` (default) runs the batch eagerly, counted in
    ``run_stats()`` under the reason ``"asleep"``; ``raise`` raises
    ``RunnerAsleepError``.
``capture``
    When the graphs are captured: ``blocking`` (default) captures every size inside
    ``runner.capture()``; ``eager_first`` makes ``capture()`` return at once, serves every
    batch whose size holds no graph yet eagerly (counted in ``run_stats()`` under
    ``"not captured yet"``) and captures in ``runner.capture_step(budget_ms)`` calls, the
    sizes live traffic used first (``cuda_graph_runner.runner.lazy_capture``).

Every error is a :class:`CudaGraphConfigError` (a ``ValueError``) whose message
names the phase, the key, the bad value, what is accepted and, where known,
which source (flag, JSON) set it.

Precedence (lowest to highest)
------------------------------
1. defaults;
2. ``--disable-cuda-graph`` (deprecated);
3. the per-phase off switches (``--disable-{decode,prefill}-cuda-graph``);
4. the flags that name a value, the deprecated aliases among them (an alias shares its
   replacement's storage: the one written last wins);
5. ``--cuda-graph-config`` (JSON).

A higher tier overrides a lower one key by key. Within one tier, a flag for one
phase beats a flag for both phases (``--cuda-graph-tc-compiler inductor
--cuda-graph-tc-compiler-decode eager`` gives decode eager, prefill inductor);
two flags of one tier that give the same (phase, key) different values are an
error. :attr:`CudaGraphConfig.sources` records, for every explicitly set
(phase, key), the source that won: ``"api"``, ``"json"``,
``"json:--cuda-graph-config"``, ``"flag:<option>"`` or ``"legacy:<option>"``;
:meth:`CudaGraphConfig.source_of` answers ``"default"`` for the rest.

Flags added by :func:`add_cuda_graph_args`
------------------------------------------
``--cuda-graph-config JSON_OR_PATH``
    A JSON object ``{"decode": {...}, "prefill": {...}}`` (keys as above), or
    the path of a file holding one. Unknown phases/keys are errors.
``--cuda-graph-backend-{decode,prefill} NAME``
    The phase's backend.
``--cuda-graph-max-bs-{decode,prefill} N``
    The phase's ``max_bs``.
``--cuda-graph-bs-{decode,prefill} N [N ...]``
    The phase's ``bs``; space and/or comma separated (``1 2 4`` or ``1,2,4``).
``--cuda-graph-tc-compiler-{decode,prefill} {eager,inductor}``
    The phase's ``tc_compiler``.
``--cuda-graph-tc-compiler {eager,inductor}``
    ``tc_compiler`` of both phases.
``--cuda-graph-compile-sizes-decode N [N ...]``
    Decode's ``compile_sizes``; space and/or comma separated (no shipped prefill
    backend reads the key; JSON sets it for prefill).
``--disable-{decode,prefill}-cuda-graph``, ``--disable-cuda-graph-{decode,prefill}``
    The phase's backend is ``disabled`` unless ``--cuda-graph-backend-{decode,prefill}``
    names one (sglang's off switches, below the backend flags; the two spellings are one).
``--enable-torch-compile``
    Decode ``torch_compile`` on: backend ``full`` compiles the forward with inductor
    before capturing it (compiled full; sglang's flag).
``--torch-compile-max-bs N``
    Decode ``torch_compile_max_bs``: the largest batch size captured from the compiled
    forward (default 32, sglang's); larger ones capture the forward as written.

Deprecated sglang flags, each mapped onto the keys above. As in sglang, an alias writes
the storage of the flag it replaces, so of an alias and its replacement the one written
last wins (``--cuda-graph-max-bs-decode 16 --cuda-graph-max-bs 8``: 8);
``--disable-cuda-graph`` alone is a tier below every other flag:

=====================================  ===========================================
``--disable-cuda-graph``               decode and prefill backend ``disabled``
``--enable-breakable-cuda-graph``      prefill backend ``breakable``
``--disable-piecewise-cuda-graph``     prefill backend ``disabled``
``--enforce-piecewise-cuda-graph``     prefill backend ``tc_piecewise``
``--cuda-graph-max-bs N``              decode ``max_bs``
``--cuda-graph-bs N [N ...]``          decode ``bs``
``--piecewise-cuda-graph-tokens N..``  prefill ``bs``
``--piecewise-cuda-graph-max-tokens``  prefill ``max_bs``
``--piecewise-cuda-graph-compiler C``  ``tc_compiler`` of both phases
=====================================  ===========================================

Using one emits a ``FutureWarning`` (shown to end users by default, unlike
``DeprecationWarning``) naming its replacement, once per flag per process: a
second parse in the same process, or the flag repeated, does not warn again.

Where a command line means something else in sglang 0.5.14, sglang's meaning holds;
the few deliberate differences are listed in ``docs/sglang-compat.md``.

The package
-----------
``exceptions`` (:class:`CudaGraphConfigError`), ``model`` (the keys, :class:`PhaseConfig`,
:class:`CudaGraphConfig`), ``convert`` (:func:`as_config`: every accepted config form, converted once), ``loading`` (JSON given as text or as a file) and ``flags``
(argparse, tiers, deprecated aliases) and ``sglang`` (:func:`from_sglang_dict`: a config
saved by sglang's ``to_dict``, read with sglang's defaults); every public name is importable from here.
"""

from __future__ import annotations

from .convert import ConfigInput, as_config
from .exceptions import CudaGraphConfigError
from .flags import add_cuda_graph_args, source_phases  # noqa: F401 - source_phases: backend_options
from .model import (  # noqa: F401 - SOURCE_*: exported, outside __all__
    _BACKEND_NAME,  # the one backend-name pattern; the registry may share it
    BACKEND_OPTION_KEYS,
    CAPTURE_POLICIES,
    DEFAULT_MAX_BS,
    FORWARD_ASLEEP,
    MAX_CAPTURE_SIZE,
    PHASE_KEYS,
    SOURCE_API,
    SOURCE_DEFAULT,
    SOURCE_JSON,
    SOURCE_JSON_FLAG,
    TC_COMPILERS,
    TORCH_COMPILE_MAX_BS,
    TORCH_COMPILERS,
    WARMUP_POLICIES,
    WELL_KNOWN_DISTRIBUTIONS,
    Backend,
    CudaGraphConfig,
    Phase,
    PhaseConfig,
)
from .sglang import from_sglang_dict

__all__ = [
    "Phase",
    "Backend",
    "WELL_KNOWN_DISTRIBUTIONS",
    "TC_COMPILERS",
    "TORCH_COMPILERS",
    "TORCH_COMPILE_MAX_BS",
    "WARMUP_POLICIES",
    "FORWARD_ASLEEP",
    "CAPTURE_POLICIES",
    "DEFAULT_MAX_BS",
    "MAX_CAPTURE_SIZE",
    "PHASE_KEYS",
    "BACKEND_OPTION_KEYS",
    "CudaGraphConfigError",
    "PhaseConfig",
    "CudaGraphConfig",
    "ConfigInput",
    "as_config",
    "add_cuda_graph_args",
    "from_sglang_dict",
]
