"""Mixed precision as planned: the program computes in bf16 (or fp16), the optimizer steps fp32
masters.

The reference policy, what one process does for a plan of precision ``"mixed"``: the model's
bf16 copy (``model.to(torch.bfloat16)``, floating inputs and targets cast to bf16) runs forward
and backward; after each backward its bf16 gradients are added, cast to fp32, into the ``.grad``
of fp32 master weights (the model's own fp32 values) and cleared; gradient clipping and the
user's ``torch.optim`` optimizer act on the masters (fp32 state); before the next forward the
bf16 copy is refreshed from the masters. :func:`autopar.testing.run_reference` with
``precision="mixed"`` runs exactly that in one process.

On a rank, :class:`MasterWeights` holds the fp32 masters of its parameter pieces (cut from the
model's fp32 tensors, never from their bf16 rounding); the program's parameters, buffers and
activations, and what its collectives move (parameter all-gathers, gradient all-reduces and
reduce-scatters), are bf16: the bytes the plan's costs price. Floating buffers (BatchNorm's running
statistics) are bf16 as in the bf16 copy, and are saved so. fp16 (``"mixed-fp16"``:
``Options(mixed_precision="fp16")``, or True for a model in fp16) is the same with fp16 for bf16,
and scales the loss dynamically: the masters' gradients add up scaled and are unscaled once per
optimizer step (:mod:`autopar.runtime.scaler`).

With the optimizer offloaded (``Plan.offload``, :mod:`autopar.planner.offload`) the masters live
on the host, in fp32 under mixed precision and in the parameter's own dtype otherwise (copies
even where the host is the program's device: CPU ranks): each gradient is moved down in the
program's dtype and cast there, the user's optimizer steps the host tensors, and each updated
master is cast to the program's dtype there and moved up. With the parameters offloaded too
(``Plan.offload_parameters``) the program's parameters are on the host as well: their gradients
arrive there layer by layer (:mod:`autopar.runtime.fetch`) and nothing crosses the link at the
step.
"""

from __future__ import annotations

import torch
from torch import nn

from autopar.core.errors import CodegenError
from autopar.core.precision import Precision

HOST = torch.device("cpu")  # where an offloaded optimizer's tensors live


def check_captured(captured, precision: Precision) -> None:
    """Raise CodegenError when a mixed-precision program is asked of a graph not captured in the
    compute dtype (its explicit dtypes would be the fp32 model's)."""
    wrong = sorted(fqn for fqn, meta in captured.parameters.items()
                   if precision.master and meta.dtype.is_floating_point and meta.dtype != precision.compute)
    if wrong:
        raise CodegenError(f"a {precision.name!r} program runs the model's {precision.compute} copy, but the graph"
                           f" was captured with {wrong[0]} in {captured.parameters[wrong[0]].dtype}: capture it"
                           " with capture_for_training(..., mixed_precision=True), as autopar.compile does")


def program_values(stored, pieces: dict, precision: Precision, *, host: torch.device | None = None,
                   parameters: bool = False) -> tuple[dict, MasterWeights | None]:
    """The values a rank's program starts from (``pieces``: FQN -> this rank's piece as the model
    holds it, of every ``stored`` tensor) and, under mixed precision or offloaded to ``host``,
    the masters of its parameters; ``(pieces, None)`` otherwise. ``parameters``: the program's
    floating parameters live on ``host`` too (fetched per layer, :mod:`autopar.runtime.fetch`),
    and without mixed precision the optimizer steps them there (no masters)."""
    masters = None
    if precision.master or (host is not None and not parameters):
        masters = MasterWeights({s.fqn: pieces[s.fqn] for s in stored if s.kind == "parameter"},
                                {s.fqn: s.trainable for s in stored}, host=host, fp32=precision.master)
    if precision.master:
        pieces = {fqn: t.to(precision.dtype(t.dtype)) for fqn, t in pieces.items()}
    if parameters:
        params = {s.fqn for s in stored if s.kind == "parameter"}
        pieces = {fqn: t.to(host, copy=True) if fqn in params and t.is_floating_point() else t
                  for fqn, t in pieces.items()}
    return pieces, masters


class MasterWeights:
    """Master copies of one rank's floating parameters (``pieces``: FQN -> piece as the model
    holds it; ``trainable``: FQN -> requires_grad), in fp32 (``fp32``) or their own dtype, on
    ``host`` (None: where the pieces are), and the step's traffic with the program's parameters
    (``working(fqn)``: the program's parameter)."""

    def __init__(self, pieces: dict, trainable: dict, *, host: torch.device | None = None, fp32: bool = True):
        self.masters = {fqn: nn.Parameter(_master(t, host, fp32), requires_grad=trainable[fqn])
                        for fqn, t in pieces.items() if t.is_floating_point()}

    def stepped(self, working, parameters) -> list[torch.Tensor]:
        """What the optimizer steps: the masters (``working`` and ``parameters`` as
        :meth:`autopar.runtime.zero.ZeroShards.stepped` takes them)."""
        return list(self.masters.values())

    def owned(self) -> list[torch.Tensor]:
        """The optimizer's own copies of parameters: the masters."""
        return list(self.masters.values())

    def stepped_tensor(self, fqn: str):
        """The master of ``fqn``, None where the optimizer steps the program's tensor."""
        return self.masters.get(fqn)

    def refresh(self, working) -> None:
        """Copy the masters (after the optimizer's step, or a checkpoint load) into the program."""
        with torch.no_grad():
            for fqn, master in self.masters.items():
                param = working(fqn)
                param.copy_(master.to(param.dtype))  # cast where the master lives, then moved

    def take_gradients(self, working) -> None:
        """Add the program's gradients, in fp32, into the masters' ``.grad``; clear the program's."""
        with torch.no_grad():
            for fqn, master in self.masters.items():
                param = working(fqn)
                if param.grad is None:
                    continue
                grad = param.grad.to(master.device).to(master.dtype)  # moved in the program's dtype
                master.grad = grad if master.grad is None else master.grad.add_(grad)
                param.grad = None


def _master(piece: torch.Tensor, host, fp32: bool) -> torch.Tensor:
    """A master of ``piece``: fp32 (``fp32``) or its dtype, on ``host`` (None: its device); never
    the piece itself when it lives on the host."""
    dtype = torch.float32 if fp32 else piece.dtype
    return piece.to(host or piece.device, dtype, copy=host is not None)


__all__ = ["HOST", "MasterWeights", "check_captured", "program_values"]
