"""Graph variants per size and model-owned static inputs, on the CPU (fake graph API and
the recording backend): capture count and order, the variant picked per batch, eager
fallback for an uncaptured variant, inputs filled and padded, the key format, errors."""

from __future__ import annotations

from typing import List, Optional

import pytest
import torch

from cuda_graph_runner.backend import ShapeKey
from cuda_graph_runner.backend.forward_batch import ForwardBatch
from cuda_graph_runner.config import CudaGraphConfig, CudaGraphConfigError
from cuda_graph_runner.runner import DecodeCudaGraphRunner, StaticInput
from cuda_graph_runner.runner.stats import REASON_VARIANT
from cuda_graph_runner.runner.variants import compose_key_variant, split_key_variant
from cuda_graph_runner.testing.fakes import FakeGraphDeviceModule, RecordingBackend
from cuda_graph_runner.testing.toy_model import ToyModel, decode_batch


class VariantToy(ToyModel):
    """ToyModel with variants ``plain``/``boost`` and two model-owned inputs: ``boost``
    (per request, float32, pad 0) added to the hidden state only in variant ``boost``,
    and ``tag`` (per token, int64 ``[rows, 2]``, pad -7) added in every variant."""

    def __init__(self, variants=("plain", "boost")) -> None:
        super().__init__()
        self._variants = list(variants)
        self.picked: List[str] = []

    def graph_variants(self):
        return self._variants

    def graph_variant(self, batch: ForwardBatch) -> str:
        boost = batch.extra.get("boost")
        used = boost is not None and any(float(b) != 0 for b in boost)
        variant = "boost" if used else "plain"
        self.picked.append(variant)
        return variant

    def static_inputs(self):
        return [
            StaticInput("boost", axis="batch", dtype=torch.float32, pad_value=0),
            StaticInput("tag", axis="token", dtype=torch.int64, pad_value=-7, trailing_shape=(2,)),
        ]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h = super().forward(batch)
        tag = batch.extra.get("tag")
        if tag is None:  # what the runner's buffer holds for a batch without tags
            tag = torch.full((batch.num_tokens, 2), -7)
        h = h + 0.001 * tag.float().sum(dim=1, keepdim=True)
        if batch.graph_variant != "plain":
            boost = batch.extra.get("boost")
            if boost is not None:
                if not isinstance(boost, torch.Tensor):
                    boost = torch.tensor(boost, dtype=torch.float32)
                h = h + boost.repeat_interleave(batch.num_tokens_per_req)[:, None]
        return h


def make_runner(model=None, backend=None, variants: Optional[list] = None, max_bs: int = 8, **kwargs):
    decode = {"max_bs": max_bs}
    if variants is not None:
        decode["variants"] = variants
    return DecodeCudaGraphRunner(
        model or VariantToy(),
        CudaGraphConfig.from_dict({"decode": decode}),
        device="cpu",
        backend=backend or RecordingBackend("cpu", phase="decode"),
        show_progress=False,
        **kwargs,
    )


def with_inputs(batch: ForwardBatch, boost=None, tag=None) -> ForwardBatch:
    extra = {}
    if boost is not None:
        extra["boost"] = boost
    if tag is not None:
        extra["tag"] = tag
    return batch.replace(extra=extra)


def test_capture_count_is_sizes_times_variants_largest_first_in_one_pool():
    from cuda_graph_runner_full.backend import FullCudaGraphBackend

    fake = FakeGraphDeviceModule()
    backend = FullCudaGraphBackend("cpu", phase="decode", device_module=fake, memory_pool="pool-0")
    runner = make_runner(backend=backend)
    runner.capture()
    sizes = runner.capture_sizes
    assert sizes == [1, 2, 4, 8]
    begins = [e for e in fake.events if e[0] == "capture_begin"]
    assert len(begins) == len(sizes) * 2 and {e[2] for e in begins} == {"pool-0"}
    expected = [ShapeKey(s, f"decode|{v}") for s in (8, 4, 2, 1) for v in ("plain", "boost")]
    assert backend.captured_keys == expected
    assert runner.captured_keys == expected


def test_each_variant_is_recorded_with_its_label_and_live_batches_pick_theirs():
    runner = make_runner()
    runner.capture()
    # The static batch of each capture carried its variant (the model records its code).
    assert runner.backend.captured() == [ShapeKey(s, f"decode|{v}") for s in (8, 4, 2, 1) for v in ("plain", "boost")]
    plain = with_inputs(decode_batch(3))
    boosted = with_inputs(decode_batch(3), boost=[0.0, 2.0, 0.0])
    for batch, variant in ((plain, "plain"), (boosted, "boost"), (plain, "plain")):
        got = runner.forward(batch).clone()
        assert runner.backend.events[-1] == ("replay", ShapeKey(4, f"decode|{variant}"))
        torch.testing.assert_close(got, runner.eager_forward(batch), rtol=0, atol=1e-5)
    # One call to the model per step: can_run's pick is reused by replay_prepare.
    runner.model.picked.clear()
    runner.forward(boosted)
    assert runner.model.picked == ["boost"]
    assert runner.run_stats()["eager_total"] == 0


def test_an_uncaptured_variant_runs_eagerly_with_its_reason():
    runner = make_runner(variants=["plain"])
    runner.capture()
    assert runner.backend.captured() == [ShapeKey(s, "decode|plain") for s in (8, 4, 2, 1)]
    boosted = with_inputs(decode_batch(2), boost=[1.0, 1.0])
    assert not runner.can_run(boosted)
    replays = len([e for e in runner.backend.events if e[0] == "replay"])
    out = runner.forward(boosted)
    assert len([e for e in runner.backend.events if e[0] == "replay"]) == replays  # eager, no replay
    torch.testing.assert_close(out, runner.eager_forward(boosted))
    assert runner.run_stats()["eager_fallbacks"] == {REASON_VARIANT: 1}
    runner.forward(with_inputs(decode_batch(2)))
    assert runner.run_stats()["replays"] == 1


def test_config_variants_pick_order_and_subset():
    runner = make_runner(variants=["boost", "plain", "boost"])
    assert runner.variants == ["boost", "plain"]  # duplicates dropped, order kept
    runner.capture(sizes=[2])
    assert runner.backend.captured() == [ShapeKey(2, "decode|boost"), ShapeKey(2, "decode|plain")]


def test_config_naming_a_variant_the_model_lacks_is_an_error():
    with pytest.raises(
        ValueError, match=r"variants \['turbo'\] are not among the model's variants \['plain', 'boost'\]"
    ):
        make_runner(variants=["plain", "turbo"])
    with pytest.raises(ValueError, match="declares none"):
        make_runner(model=ToyModel(), variants=["plain"])


@pytest.mark.parametrize("bad", [[], "lora", ["a|b"], ["x:1"], [""], [3], {"lora": 1}])
def test_config_rejects_bad_variant_lists(bad):
    with pytest.raises(CudaGraphConfigError, match="variants"):
        CudaGraphConfig.from_dict({"decode": {"variants": bad}})


def test_config_variants_round_trip():
    cfg = CudaGraphConfig.from_dict({"decode": {"variants": ["nolora", "lora"]}})
    assert cfg.decode.variants == ["nolora", "lora"] and cfg.prefill.variants is None
    assert CudaGraphConfig.from_dict(cfg.to_dict()) == cfg


def test_a_model_without_variants_has_one_graph_per_size_and_mode_only_keys():
    runner = make_runner(model=ToyModel())
    assert runner.variants == [""]
    runner.capture()
    assert runner.backend.captured() == [ShapeKey(s, "decode") for s in (8, 4, 2, 1)]
    tv = DecodeCudaGraphRunner(
        ToyModel(),
        {"decode": {"max_bs": 2}},
        mode="target_verify",
        num_tokens_per_req=3,
        device="cpu",
        backend=RecordingBackend("cpu", phase="decode"),
        show_progress=False,
    )
    assert tv.make_key(2) == ShapeKey(2, "target_verify:3")


def test_key_format_composes_mode_and_variant():
    assert compose_key_variant("decode") == "decode"
    assert compose_key_variant("target_verify:4", "lora") == "target_verify:4|lora"
    assert split_key_variant("dllm_extend:8|nolora") == ("dllm_extend:8", "nolora")
    assert split_key_variant("decode") == ("decode", "")
    runner = make_runner(model=VariantToy(), mode="dllm_extend", num_tokens_per_req=4)
    assert runner.make_key(8, "boost") == ShapeKey(8, "dllm_extend:4|boost")


def test_model_inputs_are_filled_and_padded_like_the_runners_slots():
    runner = make_runner()
    runner.capture()
    buffers = runner.buffers
    assert buffers["boost"].shape == (8,) and buffers["tag"].shape == (8, 2)
    big_tag = torch.arange(10).view(5, 2) + 1
    runner.forward(with_inputs(decode_batch(5), boost=[1.0, 2.0, 3.0, 4.0, 5.0], tag=big_tag))
    assert buffers["boost"].tolist() == [1, 2, 3, 4, 5, 0, 0, 0]
    assert buffers["tag"][:5].tolist() == big_tag.tolist() and (buffers["tag"][5:] == -7).all()
    # A smaller batch: live rows rewritten, the rows the larger one left are padded again.
    small_tag = torch.tensor([[9, 9], [8, 8], [6, 6]])
    runner.forward(with_inputs(decode_batch(3), boost=torch.tensor([7.0, 0.0, 1.0]), tag=small_tag))
    assert buffers["boost"][:4].tolist() == [7, 0, 1, 0]  # padded to the captured 4
    assert buffers["tag"][:3].tolist() == small_tag.tolist() and (buffers["tag"][3:4] == -7).all()
    # No value in the batch: every row of the captured size holds the pad value.
    runner.forward(with_inputs(decode_batch(3)))
    assert buffers["boost"][:4].tolist() == [0, 0, 0, 0] and (buffers["tag"][:4] == -7).all()


def test_model_inputs_reach_the_replayed_graph_through_extra():
    runner = make_runner()
    runner.capture()
    tag = torch.tensor([[1, 2], [3, 4], [5, 6]])
    batch = with_inputs(decode_batch(3), boost=[0.5, 0.0, 1.5], tag=tag)
    got = runner.forward(batch).clone()
    torch.testing.assert_close(got, runner.eager_forward(batch), rtol=0, atol=1e-5)
    # The live batch's extra is left as it was (the runner copies, never rebinds it).
    assert batch.extra["tag"] is tag and batch.extra["boost"] == [0.5, 0.0, 1.5]


def test_model_input_of_the_wrong_shape_or_type_is_a_clear_error():
    runner = make_runner()
    runner.capture()
    with pytest.raises(ValueError, match=r"static input 'tag'.*shape \(3,\), expected \(3, 2\)"):
        runner.forward(with_inputs(decode_batch(3), tag=torch.zeros(3, dtype=torch.int64)))
    with pytest.raises(TypeError, match=r"static input 'tag'.*accepted: a tensor"):
        runner.replay(with_inputs(decode_batch(3), tag="high"))


def test_model_inputs_declared_twice_or_clashing_are_refused():
    class Clash(VariantToy):
        def static_inputs(self):
            return [StaticInput("seq_lens", axis="batch", dtype=torch.int32)]

    with pytest.raises(ValueError, match="'seq_lens' is the name of one of the runner's own slots"):
        make_runner(model=Clash())
    with pytest.raises(ValueError, match="axis="):
        StaticInput("x", axis="request", dtype=torch.int32)


def test_a_model_returning_an_undeclared_variant_is_named():
    class Liar(VariantToy):
        def graph_variant(self, batch):
            return "turbo"

    runner = make_runner(model=Liar())
    runner.capture(sizes=[1])
    with pytest.raises(ValueError, match=r"graph_variant\(batch\) returned 'turbo'"):
        runner.forward(decode_batch(1))


def test_model_input_of_another_dtype_kind_is_refused_not_cast():
    runner = make_runner()
    runner.capture(sizes=[4])
    tag = torch.tensor([[1.5, 2.0], [3.0, 4.0], [5.0, 6.0]])
    with pytest.raises(ValueError, match=r"static input 'tag': extra\['tag'\] is torch.float32, expected torch.int64"):
        runner.replay(with_inputs(decode_batch(3), tag=tag))
    with pytest.raises(ValueError, match=r"host list extra\['tag'\] is torch.float32, expected torch.int64"):
        runner.replay(with_inputs(decode_batch(3), tag=tag.tolist()))
    # Python ints for a float input are exact: accepted, as integer tensors of another width are.
    runner.replay(with_inputs(decode_batch(3), boost=[1, 0, 2], tag=torch.ones(3, 2, dtype=torch.int32)))
    assert runner.buffers["boost"][:4].tolist() == [1.0, 0.0, 2.0, 0.0] and runner.buffers["tag"][:3].eq(1).all()


def test_a_batch_refreshed_in_place_after_can_run_replays_its_new_variant():
    model = VariantToy()
    runner = make_runner(model=model)
    runner.capture(sizes=[4])
    batch = decode_batch(3)
    assert runner.can_run(batch) and model.picked[-1] == "plain"
    batch.extra["boost"] = [1.0, 2.0, 3.0]  # the engine refreshes the same object (adapters set)
    got = runner.replay(batch).clone()
    assert model.picked[-1] == "boost"
    torch.testing.assert_close(got, runner.eager_forward(batch), rtol=0, atol=1e-5)
    # forward asks the model once per step and replays what it decided.
    model.picked.clear()
    runner.forward(batch)
    assert model.picked == ["boost"]


def test_no_live_batch_is_kept_past_its_step():
    import gc
    import weakref

    runner = make_runner()
    runner.capture(sizes=[4])
    refs = []
    # can_run, a replay, and an eager fallback after a decision (size 1 was not captured).
    for call, bs in ((runner.can_run, 3), (runner.forward, 3), (runner.forward, 1)):
        batch = decode_batch(bs)
        call(batch)
        refs.append(weakref.ref(batch))
        del batch
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
    assert runner.run_stats()["eager_fallbacks"] == {"variant not captured": 1}
