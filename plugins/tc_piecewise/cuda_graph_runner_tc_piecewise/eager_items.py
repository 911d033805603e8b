"""Marked ops between the pieces, called without torch's custom-op dispatcher.

Dynamo records a marked op (:mod:`cuda_graph_runner.backend.graph_break`) as a call of its
``torch.ops.cuda_graph_runner.<name>`` custom op, so the split module's eager items go
through the dispatcher at every step: the autograd layer, ``ADInplaceOrView`` (a version
bump of ``output``), the device-kernel lookup and a ``torch._dynamo.disable`` wrapper,
before the op's Python body runs. That is 25-35 µs per call on a desktop CPU, once per
layer and step (16 times per decode step of a 16-layer model), which is most of what a
batch-1 replay spends on the host besides the graph launches.

At replay the split module runs under ``torch.no_grad()`` (so the autograd layer does
nothing) and outside Dynamo (it is the backend's compiled function, which Dynamo calls
with itself disabled, or the direct replay), so the custom op adds nothing but its cost:
:func:`direct_eager_forward` rewrites an eager item to call the op's body directly, the
way the custom op's own kernel does (``host_guard.run_marked_op(fn, args, kwargs)``: the
host-value guard lifted while the body runs). vLLM and sglang call their attention
between the pieces as plain Python too.

An op whose custom op has more than its default kernel (``torch.library.register_kernel``
for a device, ``register_autograd``, a ``register_torch_dispatch`` rule, vmap or autocast
rules, a ``torch.library.impl`` kernel for a dispatch key) keeps the dispatcher: skipping
it would skip those. The check reads torch's custom-op definition
(``torch._library.custom_ops.OPDEFS``) and the dispatcher's table; where the definition is
not as this module expects (another torch), every op keeps the dispatcher. What a direct
call loses besides: the profiler's ``cuda_graph_runner::<op>`` range and the op as one
unit for a ``TorchDispatchMode`` (modes see the body's aten ops).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from cuda_graph_runner.backend import EagerOp, eager_op_for_target, run_marked_op

logger = logging.getLogger(__name__)


def generated_forward(module: fx.GraphModule) -> Callable[..., Any]:
    """``module``'s generated ``forward`` itself. A lazily recompiled ``GraphModule`` (what
    ``split_module`` and ``recompile()`` give in recent torch) has a stub ``forward`` that
    compiles the code on first use and then goes through ``nn.Module.__call__`` at every
    call (a few µs each, per piece and step): compiled now, the bound method is the code."""
    real = getattr(module, "real_recompile", None)
    if callable(real):
        real()
    return module.forward


#: What ``torch.library`` may have registered on a custom op besides its default kernel
#: (``CustomOpDef`` attributes; the autocast ones changed name across torch versions).
_OTHER_REGISTRATIONS = (
    "_torch_dispatch_fns",
    "_backward_fn",
    "_setup_context_fn",
    "_vmap_fn",
    "_autocast_dtype",
    "_autocast_cuda_dtype",
    "_autocast_cpu_dtype",
    "_disabled_kernel",
)


#: Dispatch keys a fresh custom op has no kernel at (it has ``Autograd``,
#: ``CompositeExplicitAutograd`` and ``Meta``): a kernel here came from
#: ``torch.library.impl`` or a ``Library(..., "IMPL")``, which the definition never sees.
_EXTRA_DISPATCH_KEYS = (
    "CPU",
    "CUDA",
    "XPU",
    "MPS",
    "HPU",
    "PrivateUse1",
    "AutogradCPU",
    "AutogradCUDA",
    "AutogradXPU",
    "AutogradPrivateUse1",
    "AutocastCPU",
    "AutocastCUDA",
    "AutocastXPU",
    "AutocastPrivateUse1",
    "FuncTorchBatched",
    "Functionalize",
    "CompositeImplicitAutograd",
)


def _kernel_registered_at(qualname: str, key: str) -> bool:
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key))
    except Exception:  # a key this torch does not know: no kernel can be there
        return False


def has_default_kernel_only(op: EagerOp) -> bool:
    """Whether ``op``'s custom op dispatches to nothing but the body it was registered with
    (then calling the body directly is the same computation). False when unsure.

    Checked both on the custom-op definition (``torch.library.register_kernel`` and the
    other ``register_*`` rules) and on the dispatcher (``torch.library.impl``). Read when
    tc_piecewise compiles: register extra kernels before ``runner.capture()``.
    """
    try:
        from torch._library.custom_ops import OPDEFS

        opdef = OPDEFS.get(op.qualname)
        if opdef is None:
            return False
        # An attribute a torch version lacks is a registration that version cannot make.
        others = [getattr(opdef, name, None) for name in _OTHER_REGISTRATIONS]
        if set(opdef._backend_fns) != {None} or any(others):
            return False
        return not any(_kernel_registered_at(op.qualname, key) for key in _EXTRA_DISPATCH_KEYS)
    except Exception:  # private torch state: any surprise keeps the dispatcher
        return False


def body_call(op: EagerOp) -> Callable[..., None]:
    """``op``'s body as the custom op's kernel runs it (host-value guard lifted), as a plain
    function FX code can call."""
    fn = op.fn

    def run(*args: Any, **kwargs: Any) -> Any:
        return run_marked_op(fn, args, kwargs)

    run.__name__ = run.__qualname__ = f"{op.name}_body"
    return run


def direct_eager_forward(module: fx.GraphModule) -> Optional[Callable[..., Any]]:
    """The forward of an eager item (``module``: the split module's submodule of one marked
    op) with its marked-op call made directly on the op's body, or None when the item
    keeps its custom-op call (an op with other kernels, or a node that is no marked op).

    ``module``'s graph is rewritten and recompiled in place (only its call target changes;
    arguments, constants and the output stay as Dynamo recorded them).
    """
    calls = [n for n in module.graph.nodes if n.op == "call_function"]
    ops = [eager_op_for_target(n.target) for n in calls]
    if not calls or any(op is None or not has_default_kernel_only(op) for op in ops):
        return None
    for node, op in zip(calls, ops):
        node.target = body_call(op)  # type: ignore[arg-type]  # an EagerOp here, checked above
    module.recompile()
    forward = generated_forward(module)
    logger.debug("tc_piecewise: marked ops %s called without the dispatcher", [o.name for o in ops if o is not None])
    return forward
