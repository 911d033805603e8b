"""The flags of ``cuda-graph-runner bench`` (docs/cli.md)."""

from __future__ import annotations

import argparse
import os

import torch

from ...config import add_cuda_graph_args
from ...config.flags import FlattenSizes, sizes_arg
from ...config.integers import count_arg

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FORMATS = ("table", "json", "csv")


def _backend_list(text: str) -> str:
    """argparse type of ``--decode-backends``/``--prefill-backends``: a comma-separated list
    with at least one name (an empty value would silently mean "the config's backend")."""
    if not [name for name in text.split(",") if name.strip()]:
        raise argparse.ArgumentTypeError(
            f"expected at least one backend name (name[:tc_compiler], comma-separated, e.g. full,breakable); got {text!r}"
        )
    return text


def output_file(text: str) -> str:
    """argparse type of ``--json``/``--plot``: a file the bench can write, checked when the
    flags are parsed, before minutes of capture and timing (not after, losing the results).

    Raises:
        argparse.ArgumentTypeError: ``text`` is empty, names a directory or an unwritable
            file, or its folder does not exist or is not writable.
    """
    if not text:
        raise argparse.ArgumentTypeError("expected a file path; got ''")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is a directory; accepted: a file path (e.g. {text.rstrip('/')}/out)"
        )
    if os.path.exists(text) and not os.access(text, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not writable; accepted: a writable file path")
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(
            f"{text!r}: folder {folder!r} does not exist or is not writable; accepted: a path in a writable folder"
        )
    # os.access answers yes to root everywhere (/proc, /sys): open the file for real.
    existed = os.path.exists(text)
    try:
        with open(text, "a"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r} cannot be written ({exc.strerror or exc}); accepted: a writable file path"
        ) from None
    if not existed:
        os.remove(text)
    return text


def attention_arg(text: str) -> str:
    """argparse type of ``--attention``: a name of the reference model's attention backends."""
    from ...reference.model.attention_backend import ATTENTION_BACKENDS, attention_backend_names

    if text not in ATTENTION_BACKENDS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an attention backend; accepted: {', '.join(attention_backend_names())}"
        )
    return text


def add_model_arguments(parser: argparse.ArgumentParser, *, measured: bool = True) -> None:
    """The flags that say what ``bench`` and ``inspect`` capture: the model, its device,
    attention and dtype, the sizes and the backends of each phase (``measured``: the
    bench's help, which times the sizes; else ``inspect``'s, which only captures)."""
    parser.add_argument(
        "--model",
        default=None,
        help="preset name, real trained model (smollm2-135m: prepared once into the cache, prints generated "
        "text; needs cuda-graph-runner[smollm2]), Hugging Face checkpoint directory, or hf:ARCH / hf:FOLDER "
        "(transformers' own llama, qwen2, mistral or qwen3 code through the adapter, random weights or a "
        "checkpoint; each decode row shows its match against HF's eager forward; needs "
        "cuda-graph-runner[transformers]) (default: llama-3.2-1b on CUDA, tiny on CPU)",
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument(
        "--attention",
        type=attention_arg,
        default=None,
        metavar="NAME",
        help="the reference model's attention backend: torch (the default on every device, CUDA included), "
        "triton (Triton paged kernels on CUDA; needs cuda-graph-runner[triton]), "
        "flashinfer and flashinfer_tc (FlashInfer's decode wrappers, plain and tensor-core, on CUDA in bf16/fp16; "
        "needs cuda-graph-runner[flashinfer]) "
        "or planned_standin (a CPU stand-in of a plan-based attention, for testing the runner's hooks)",
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="model dtype (default: bfloat16 on CUDA, float32 on CPU)"
    )
    parser.add_argument(
        "--batch-sizes",
        type=sizes_arg,
        action=FlattenSizes,
        nargs="+",
        metavar="N",
        default=None,
        help=(
            "decode batch sizes to time, space or comma separated (default: 1 4 16 64 on CUDA, 1 2 4 on CPU)"
            if measured
            else "decode batch sizes, space or comma separated: the largest is decode's max_bs when the config "
            "sets neither max_bs nor bs, as in bench (default: 1 4 16 64 on CUDA, 1 2 4 on CPU)"
        ),
    )
    parser.add_argument(
        "--decode-backends",
        type=_backend_list,
        default=None,
        help="comma-separated decode backends to bench, each name[:tc_compiler] or name+torch_compile "
        "(compiled full), e.g. full,full+torch_compile,tc_piecewise:inductor (default: the config's decode backend; where that is "
        "the device's default and the default is disabled, as on the CPU, the bench runs "
        "compiled when installed, unless CUDA_GRAPH_RUNNER_BENCH_CPU_COMPILED=0)",
    )
    parser.add_argument(
        "--prefill-backends",
        type=_backend_list,
        default=None,
        help="comma-separated prefill backends to bench, each name[:tc_compiler] "
        "(default: the config's prefill backend)",
    )
    parser.add_argument(
        "--prefill-tokens",
        type=sizes_arg,
        action=FlattenSizes,
        nargs="+",
        metavar="N",
        default=None,
        help=(
            "prefill token counts to time, space or comma separated (default: 64 256 1024 on CUDA, 16 48 on CPU)"
            if measured
            else "prefill token counts, space or comma separated: the largest is prefill's max_bs when the config "
            "sets neither max_bs nor bs, as in bench (default: 64 256 1024 on CUDA, 16 48 on CPU)"
        ),
    )


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` flags (plus every CUDA-graph config flag)."""
    add_model_arguments(parser)
    parser.add_argument(
        "--prefill-requests",
        type=sizes_arg,
        action=FlattenSizes,
        nargs="+",
        metavar="N",
        default=[1, 4],
        help="requests per prefill batch, space or comma separated (default: 1 4)",
    )
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill section")
    parser.add_argument(
        "--prompt-len", type=count_arg(1), default=32, metavar="N", help="prompt tokens before decoding (default 32)"
    )
    parser.add_argument(
        "--steps",
        type=count_arg(1),
        default=16,
        metavar="N",
        help="greedy decode steps compared with eager (default 16)",
    )
    parser.add_argument(
        "--iters",
        type=count_arg(1),
        metavar="N",
        default=None,
        help="calls per timed block; eager and the backend alternate over 5 rounds (15 on CPU) of one block "
        "each, the median round and per-round ratio are reported (default 20 on CUDA, 2 on CPU)",
    )
    parser.add_argument(
        "--threads",
        type=count_arg(1),
        default=None,
        metavar="N",
        help="torch intra-op threads for the run (default on a CPU: half the CPUs this process may run on, "
        "1 on a 2-core machine, so other processes do not stall every step; OMP_NUM_THREADS or "
        "MKL_NUM_THREADS, when set, are kept)",
    )
    parser.add_argument(
        "--warmup",
        type=count_arg(0),
        default=3,
        metavar="N",
        help="untimed runs before each measurement, 0 for none (default 3)",
    )
    parser.add_argument(
        "--tp",
        type=count_arg(1),
        metavar="N",
        default=1,
        help="tensor-parallel size; >1 runs under torchrun --nproc-per-node N, rank 0 prints (default 1)",
    )
    parser.add_argument(
        "--dp",
        type=count_arg(1),
        metavar="N",
        default=1,
        help="data-parallel attention size (the reference model's DP layout, every rank padded to the largest "
        "batch each step); >1 runs under torchrun --nproc-per-node N, rank 0 prints; not with --tp (default 1)",
    )
    parser.add_argument(
        "--json",
        dest="json_path",
        type=output_file,
        default=None,
        metavar="FILE",
        help="also write the results as JSON to this file",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="table",
        help="stdout format: table (default, for people), json (the --json document) or csv "
        "(one row per measurement); with json/csv the progress text goes to stderr",
    )
    parser.add_argument(
        "--plot",
        dest="plot_path",
        type=output_file,
        default=None,
        metavar="FILE",
        help="also draw ms per step against batch size (and prefill ms against tokens) per "
        "backend, eager included, into this PNG (needs cuda-graph-runner[plot])",
    )
    add_cuda_graph_args(parser)
