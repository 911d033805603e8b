"""The conformance kit's ``test_device_*`` tests: the reference model captured and
replayed with the backend on a device where it is available, compared with eager.

A mixin of :class:`~cuda_graph_runner.testing.conformance.BackendConformanceTests`, which
provides the helpers these tests call (``device_or_skip``, ``make_model``,
``assert_close``, ``_require_phase``) and the class attributes (``decode_max_bs``, ...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Tuple

import pytest

if TYPE_CHECKING:
    from ...runner import DecodeCudaGraphRunner

#: The device tests, in the order the kit defines them (``device_marks`` marks each).
DEVICE_TESTS = (
    "test_device_decode_capture_replay_matches_eager",
    "test_device_target_verify_matches_eager",
    "test_device_prefill_capture_replay_matches_eager",
    "test_device_cleanup_then_recapture",
    "test_device_runner_on_second_device_matches_eager",
    "test_device_owned_outputs_survive_later_replays",
    "test_device_reference_model_passes_verify_mode",
    "test_device_replay_never_runs_the_capture_batch",
    "test_device_plan_based_attention_is_planned_before_every_forward",
    "test_device_mixed_two_dimensional_keys_match_eager",
)


class DeviceConformanceTests:
    """The ``test_device_*`` tests (see the module docstring)."""

    # Provided by BackendConformanceTests (declared for the type checker only, so the
    # kit's ClassVar defaults stay the ones that count).
    if TYPE_CHECKING:
        backend_name: ClassVar[str]
        decode_max_bs: ClassVar[int]
        decode_batch_sizes: ClassVar[Tuple[int, ...]]
        supports_target_verify: ClassVar[bool]
        prefill_max_tokens: ClassVar[int]
        prefill_prompt_lens: ClassVar[Tuple[Tuple[int, ...], ...]]
        mixed_tokens: ClassVar[Tuple[int, ...]]
        mixed_requests: ClassVar[Tuple[int, ...]]

        def _require_phase(self, phase: str) -> None: ...
        def device_or_skip(self) -> str: ...
        def make_model(
            self,
            device_type: str,
            *,
            num_slots: int = ...,
            max_reqs: int = ...,
            max_context_len: int = ...,
            attention: Any = ...,
        ) -> Any: ...
        def assert_close(self, got: Any, expected: Any, what: str) -> None: ...

    def _decode_runner(
        self, device: str, max_bs: int, *, attention: Any = None, **options: Any
    ) -> Tuple[Any, "DecodeCudaGraphRunner"]:
        """``(model, runner)``: the kit's model on ``device`` (with the attention backend
        ``attention``, None: the model's default) and a decode runner of this backend for it
        up to ``max_bs`` (``options``: the runner's keyword arguments)."""
        from ...runner import DecodeCudaGraphRunner

        model = self.make_model(device) if attention is None else self.make_model(device, attention=attention)
        config = {"decode": {"backend": self.backend_name, "max_bs": max_bs}}
        return model, DecodeCudaGraphRunner(model, config, show_progress=False, **options)

    def test_device_decode_capture_replay_matches_eager(self) -> None:
        self._require_phase("decode")
        device_type = self.device_or_skip()
        import torch

        from ...reference.batches import GreedySession, eager_logits_fn, make_decode_batch, make_dummy_prompts

        model, runner = self._decode_runner(device_type, self.decode_max_bs)
        cache = model.kv_cache
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

        from ...backend.forward_batch import ForwardMode
        from ...reference.batches import (
            eager_logits_fn,
            make_dummy_prompts,
            make_extend_batch,
            make_target_verify_batch,
        )

        width = 3
        model, runner = self._decode_runner(device_type, 4, mode=ForwardMode.TARGET_VERIFY, num_tokens_per_req=width)
        cache = model.kv_cache
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
            from ...runner import PrefillCudaGraphRunner
        except ImportError as exc:  # an older core
            pytest.skip(f"this core has no PrefillCudaGraphRunner: {exc}")
        from ...config import CudaGraphConfigError
        from ...reference.batches import eager_logits_fn, make_dummy_prompts, make_extend_batch

        # Request slots for backends that fix the request axis (full); the others ignore it.
        slots = max(len(lens) for lens in self.prefill_prompt_lens)
        config = {
            "prefill": {"backend": self.backend_name, "max_bs": self.prefill_max_tokens, "full_prefill_max_req": slots}
        }
        model = self.make_model(device_type)
        try:
            runner = PrefillCudaGraphRunner(model, config, show_progress=False)
        except CudaGraphConfigError as exc:
            if exc.key != "backend" or "init_forward_metadata_replay" not in str(exc):
                raise
            # A backend that records attention into prefill graphs (full) needs a plan-based
            # attention: the stand-in runs on any device.
            model = self.make_model(device_type, attention="planned_standin")
            runner = PrefillCudaGraphRunner(model, config, show_progress=False)
        cache = model.kv_cache
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

        from ...reference.batches import GreedySession, eager_logits_fn, make_decode_batch, make_dummy_prompts

        model, runner = self._decode_runner(device_type, 4)
        cache = model.kv_cache
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

        from ...reference.batches import GreedySession, eager_logits_fn, make_decode_batch, make_dummy_prompts

        module = torch.get_device_module(device_type)
        count = module.device_count() if device_type != "cpu" and hasattr(module, "device_count") else 1
        if count < 2:
            pytest.skip(
                f"needs 2 {device_type} devices (a runner on {device_type}:1 while {device_type}:0 is "
                f"current); this machine has {count}"
            )
        module.set_device(0)
        model, runner = self._decode_runner(f"{device_type}:1", self.decode_max_bs)
        cache = model.kv_cache
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

        from ...reference.batches import GreedySession, eager_logits_fn, make_decode_batch, make_dummy_prompts

        model, runner = self._decode_runner(device_type, self.decode_max_bs, owned_outputs=True)
        cache = model.kv_cache
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

        from ...reference.batches import GreedySession, make_dummy_prompts
        from ...runner import DecodeCudaGraphRunner

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

    def test_device_replay_never_runs_the_capture_batch(self) -> None:
        """A replay never runs the forward on a capture-time batch.

        ``capture_one``'s ``forward_fn`` is bound to the dummy batch the key was captured
        with. A graph backend never calls it again; an eager backend that stores it and
        calls it in ``replay`` recomputes the dummy batch, which decode hides (its inputs
        live in the static buffers the dummy batch views) and prefill does not (its
        per-request lengths live in the batch object). The runner's forward is wrapped to
        record the batch of every call: those of ``capture()`` are the capture batches,
        and no call during ``forward`` may receive one of them.
        """
        self._require_phase("decode")
        device_type = self.device_or_skip()
        import torch

        from ...reference.batches import GreedySession, eager_logits_fn, make_decode_batch, make_dummy_prompts

        model, runner = self._decode_runner(device_type, 4)
        seen: list = []
        graph_forward = runner.graph_forward

        def recording_forward(batch: Any) -> Any:
            seen.append(batch)
            return graph_forward(batch)

        runner.graph_forward = recording_forward  # type: ignore[method-assign]
        with torch.no_grad():
            runner.capture()
            capture_batches = list(seen)
            seen.clear()
            session = GreedySession(model, model.kv_cache)
            session.prefill(make_dummy_prompts(3, [3, 5, 4], model.config.vocab_size, seed=5))
            batch = make_decode_batch(model.kv_cache, session.rows, None, [t[-1] for t in session.tokens])
            expected = eager_logits_fn(model)(batch).clone()
            assert runner.can_run(batch), "batch size 3 <= max_bs 4 cannot replay"
            seen.clear()
            got = runner.forward(batch).clone()
            session.close()
            runner.cleanup()
        stale = [b for b in seen if any(b is c for c in capture_batches)]
        assert not stale, (
            f"backend {self.backend_name!r}: a replay ran the forward on the capture-time dummy batch "
            f"(batch size {stale[0].batch_size}). capture_one's forward_fn is bound to the batch it was "
            "captured with; a backend that runs the forward at replay must call "
            "self.capture_plan.forward(static_batch) with the static batch replay() receives "
            "(docs/plugin-authors.md, 'What a backend gets')"
        )
        self.assert_close(got, expected, "decode batch size 3 (capture-batch check)")

    def test_device_plan_based_attention_is_planned_before_every_forward(self) -> None:
        """The reference model with a plan-based attention (``planned_standin``, a stand-in
        that plans on the host as FlashInfer's wrappers do and fails an unplanned or stale
        forward): every capture, replay and eager fallback is planned first, a replay reads
        the plan made for it from the padded host lengths (equal to eager, no stale-plan
        count on the device), and ``cleanup()`` drops the per-size state a recapture
        builds afresh (once per size)."""
        self._require_phase("decode")
        device_type = self.device_or_skip()
        import torch

        from ...reference.batches import GreedySession, eager_logits_fn, make_decode_batch, make_dummy_prompts
        from ...runner import DecodeCudaGraphRunner

        max_bs = min(4, self.decode_max_bs)
        model = self.make_model(device_type, attention="planned_standin")
        # One captured size (compiling backends compile once per size): smaller batches pad to it.
        config = {"decode": {"backend": self.backend_name, "bs": [max_bs]}}
        runner = DecodeCudaGraphRunner(model, config, show_progress=False)
        plans = model.attn_backend
        cache = model.kv_cache
        eager = eager_logits_fn(model)
        with torch.no_grad():
            for round_ in range(2):
                runner.capture()
                assert plans.states, "capture ran the model's capture hook (init_forward_metadata_capture) for no size"
                builds = {key: plans.state_builds[key] for key in plans.states}
                assert set(builds.values()) == {round_ + 1}, f"per-size state built more than once per size: {builds}"
                for bs in sorted({max(1, max_bs - 1), max_bs + 1}):  # padded to max_bs; the eager fallback
                    session = GreedySession(model, cache)
                    lens = [3 + (i + round_) % 4 for i in range(bs)]
                    session.prefill(make_dummy_prompts(bs, lens, model.config.vocab_size, seed=10 * round_ + bs))
                    session.decode()  # requests of different lengths
                    batch = make_decode_batch(cache, session.rows, None, [t[-1] for t in session.tokens])
                    expected = eager(batch).clone()
                    before = len(plans.plan_log)
                    got = runner.forward(batch).clone()
                    made = [p.kind for p in list(plans.plan_log)[before:]]
                    want = "eager" if bs > max_bs else "replay"
                    assert made == [want], f"batch size {bs}: plans made {made}, expected one {want!r} plan"
                    self.assert_close(got, expected, f"plan-based attention, round {round_}, batch size {bs}")
                    session.close()
                plans.check()  # the device-side count of forwards that read a stale plan
                runner.cleanup()
                assert not plans.states, "cleanup() left the model's per-size attention state"

    def test_device_mixed_two_dimensional_keys_match_eager(self) -> None:
        """The mixed runner on this backend: graphs keyed by requests x tokens
        (``ShapeKey.requests``), prefill chunks beside one-token decodes, replay close to
        eager, each step on the key of fewest padded tokens then fewest request slots."""
        self._require_phase("prefill")
        device_type = self.device_or_skip()
        import torch

        try:
            from ...runner import MixedCudaGraphRunner
        except ImportError as exc:  # an older core
            pytest.skip(f"this core has no MixedCudaGraphRunner: {exc}")
        from ...config import CudaGraphConfigError
        from ...reference.batches import eager_logits_fn, make_dummy_prompts, make_extend_batch
        from ...runner.mixed import choose_key

        config = {
            "prefill": {
                "backend": self.backend_name,
                "mixed_tokens": list(self.mixed_tokens),
                "mixed_requests": list(self.mixed_requests),
            }
        }
        model = self.make_model(device_type)
        try:
            runner = MixedCudaGraphRunner(model, config, show_progress=False)
        except CudaGraphConfigError as exc:
            if exc.key != "backend" or "init_forward_metadata_replay" not in str(exc):
                raise
            # A backend that records attention (full) needs a plan-based attention.
            model = self.make_model(device_type, attention="planned_standin")
            runner = MixedCudaGraphRunner(model, config, show_progress=False)
        cache = model.kv_cache
        eager = eager_logits_fn(model)
        with torch.no_grad():
            runner.capture()
            keys = list(runner.captured_keys)
            assert keys and all(k.requests is not None for k in keys), f"captured keys {keys}"
            vocab = model.config.vocab_size
            decoding = make_dummy_prompts(3, [5, 9, 3], vocab, seed=40)
            first = make_extend_batch(cache, decoding)
            rows = first.req_pool_indices.tolist()
            chunk = make_dummy_prompts(1, [11], vocab, seed=41)[0]
            new_row = cache.alloc_request()
            steps = (
                ("a chunk beside three decodes", [chunk[:6], [1], [2], [3]], [new_row, *rows]),
                ("the chunk's rest beside two decodes", [chunk[6:], [4], [5]], [new_row, *rows[:2]]),
                ("decodes only", [[6], [7], [8]], rows),
            )
            replayed = 0
            for what, tokens, step_rows in steps:
                batch = make_extend_batch(cache, tokens, rows=step_rows)
                expected = eager(batch).clone()
                want = choose_key(keys, len(tokens), sum(len(t) for t in tokens))
                decision = runner.decide(batch)
                assert getattr(decision, "key", None) == want, f"{what}: key {decision} instead of {want}"
                replayed += runner.can_run(batch)
                got = runner.forward(batch).clone()
                assert got.shape == expected.shape
                self.assert_close(got, expected, f"mixed step: {what}")
            assert replayed, "no mixed step replayed a graph (every step fell back to eager)"
            runner.cleanup()
