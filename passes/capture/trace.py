"""Tracing: ``torch.export`` (non-strict) to functional ATen, with its failures as CaptureErrors.

:func:`trace` returns the exported program as ``run_decompositions({})`` makes it (functional
ATen that keeps aten.linear, layer_norm, scaled_dot_product_attention, cross_entropy_loss, conv2d,
embedding, ... whole), exported straight to it (:func:`exported_to_aten`) rather than exported
to the training IR and then traced again to functionalise it (:func:`exported_then_decomposed`,
the fallback): the second trace took about half of the time. Both capture the same graph (a test
compares them) but where the second trace did worse: it loses the innermost module of each node
in a ``no_grad`` block, and may list buffers out of the model's order (Gemma-4's). Straight to
ATen, AOT autograd runs the model's forward twice (a pass that collects what it mutates and
returns, then the trace; the fallback's second trace runs the exported graph instead), so what
forward prints is printed twice.
A failed trace raises :class:`autopar.CaptureError` with the tracer's
first lines, the user's line that raised and a hint; torch's own logs, and third-party messages
the user cannot act on (:data:`THIRD_PARTY_NOISE`), stay quiet meanwhile.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import re
import sys
import warnings

import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from autopar.core.errors import CaptureError
from autopar.passes.capture.loss import plain_output


@contextlib.contextmanager
def quiet_torch_logs():
    """Silence torch's tracer chatter while tracing: a failed trace logs guard details at
    WARNING/ERROR and prints its half-built graph to stderr before it raises, and the
    CaptureError says what matters. Anything else written to stderr meanwhile (the model's own
    prints) is written out afterwards."""
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name == "torch" or name.startswith("torch.")]
    before = [lg.disabled for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            yield
    except Exception as exc:
        partial = getattr(exc, "partial_fx_graph", None)
        text = stderr.getvalue()
        stderr = io.StringIO(text.replace(f"{partial}\n", "") if partial is not None else text)
        raise
    finally:
        for lg, was in zip(loggers, before):
            lg.disabled = was
        sys.stderr.write(stderr.getvalue())


# Third-party log messages that tracing a model makes libraries print and that the user cannot
# act on: (logger name prefix, pattern of the message).
THIRD_PARTY_NOISE = (
    # transformers infers the loss from the class name, fails for GPT2LMHeadModel and others,
    # warns, and uses the causal-LM loss that those models compute anyway
    ("transformers", re.compile(r"`loss_type=\w+` was set in the config but it is unrecognized")),
)


class _DropNoise(logging.Filter):
    def __init__(self, pattern):
        super().__init__()
        self.pattern = pattern

    def filter(self, record) -> bool:
        return not self.pattern.search(record.getMessage())


@contextlib.contextmanager
def quiet_third_party():
    """Drop the messages of :data:`THIRD_PARTY_NOISE` while tracing; every other message, the
    user's own warnings and logs included, passes."""
    added = []
    for prefix, pattern in THIRD_PARTY_NOISE:
        drop = _DropNoise(pattern)
        for name in [prefix] + [n for n in list(logging.root.manager.loggerDict) if n.startswith(prefix + ".")]:
            logger = logging.getLogger(name)
            logger.addFilter(drop)
            added.append((logger, drop))
    try:
        yield
    finally:
        for logger, drop in added:
            logger.removeFilter(drop)


@contextlib.contextmanager
def plain_outputs(model):
    """While tracing, ``model``'s forward returns its own dataclasses as dicts of their fields
    (:func:`~autopar.passes.capture.loss.plain_output`): torch.export flattens only the output
    types pytree knows."""
    forward, own = model.forward, "forward" in vars(model)  # an instance's own forward is put back

    @functools.wraps(forward)
    def plain_forward(*args, **kwargs):
        return plain_output(forward(*args, **kwargs))

    model.forward = plain_forward
    try:
        yield
    finally:
        if own:
            model.forward = forward
        else:
            del model.forward


def trace(model, args, kwargs) -> torch.export.ExportedProgram:
    """``model(*args, **kwargs)`` exported (non-strict) and functionalised: :func:`exported_to_aten`,
    or where that fails (or this torch lacks it), :func:`exported_then_decomposed`, whose errors are
    raised; the fallback also where forward reads a tensor's value (``.item()``: the first keeps
    the values' ranges but drops the runtime asserts on them). What the model prints or warns
    meanwhile is held, and dropped where the fallback runs, so that it is said once."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                warnings.catch_warnings(record=True) as warned:
            exported = exported_to_aten(model, args, kwargs)
    except Exception:  # noqa: BLE001 - the fallback says what is wrong, and may succeed
        return exported_then_decomposed(model, args, kwargs)
    if exported.range_constraints:  # forward read tensor values (.item()): only the fallback keeps its asserts on them
        return exported_then_decomposed(model, args, kwargs)
    sys.stdout.write(out.getvalue())
    sys.stderr.write(err.getvalue())
    for w in warned:  # they passed the filters once already
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return exported


def exported_to_aten(model, args, kwargs) -> torch.export.ExportedProgram:
    """``model(*args, **kwargs)`` exported (non-strict) straight to functional ATen, the
    CompositeImplicitAutograd ops ``run_decompositions({})`` keeps whole kept whole, and the copies
    of tensor constants forward makes (``lift_fresh_copy``) turned into the clones that a second
    trace makes of them, named as it names them (:func:`_constants_cloned`)."""
    from torch._export.utils import _collect_all_valid_cia_ops, _special_op_to_preserve_cia
    from torch.export._trace import _export
    from torch.export.exported_program import _override_composite_implicit_decomp

    kept_whole = {op: _special_op_to_preserve_cia for op in _collect_all_valid_cia_ops()}
    with quiet_torch_logs(), quiet_third_party(), plain_outputs(model), _quiet_pytree_deprecation():
        with _override_composite_implicit_decomp(kept_whole):
            exported = _export(model, args, kwargs, strict=False, pre_dispatch=False)
    _constants_cloned(exported)
    return exported


@contextlib.contextmanager
def _quiet_pytree_deprecation():
    """Without the FutureWarning torch's own tracing code raises on its deprecated pytree use
    (``isinstance(treespec, LeafSpec)``), which the user cannot act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        yield


def _constants_cloned(exported: torch.export.ExportedProgram) -> None:
    """Each ``aten.lift_fresh_copy`` of ``exported`` as ``aten.clone``, and the clones renamed
    ``clone``, ``clone_1``, ... in graph order, as ``run_decompositions`` leaves them (the
    graph signature follows)."""
    aten = torch.ops.aten
    graph = exported.graph_module.graph
    if not any(n.target is aten.lift_fresh_copy.default for n in graph.nodes):
        return
    copies = [n for n in graph.nodes if n.target in (aten.lift_fresh_copy.default, aten.clone.default)]
    names = graph._graph_namespace
    for node in copies:
        names._used_names.discard(node.name)
    names._base_count.pop("clone", None)
    renamed = {}
    for node in copies:
        node.target = aten.clone.default
        new = names.create_name("clone", None)
        renamed[node.name] = new
        node.name = new
        names._rename_object(node, new)
    for spec in (*exported.graph_signature.input_specs, *exported.graph_signature.output_specs):
        if getattr(spec.arg, "name", None) in renamed:
            spec.arg.name = renamed[spec.arg.name]
    exported.graph_module.recompile()


def exported_then_decomposed(model, args, kwargs) -> torch.export.ExportedProgram:
    """``model(*args, **kwargs)`` exported (non-strict), then functionalised by ``run_decompositions({})``."""
    try:
        with quiet_torch_logs(), quiet_third_party(), plain_outputs(model):
            exported = torch.export.export(model, args, kwargs, strict=False)
    except Exception as exc:  # the tracer's failure becomes a CaptureError, chained
        raise _capture_error(exc) from exc
    try:
        with _quiet_pytree_deprecation(), quiet_torch_logs():
            return exported.run_decompositions({})
    except Exception as exc:
        raise CaptureError(
            "torch.export traced the model but functionalizing the graph failed",
            reason=_first_lines(exc),
            hint="this is an ATen-level failure in torch; note the op named above and report it",
        ) from exc


def _first_lines(exc: BaseException, n: int = 4) -> str:
    """The tracer's message without the traceback: its first lines plus the user-code line."""
    lines = [ln.rstrip() for ln in str(exc).splitlines()]
    head = [ln for ln in lines if ln.strip()][:n]
    text = f"{type(exc).__name__}: " + "\n    ".join(head)
    for i, ln in enumerate(lines):  # export names the user's line that raised
        if ln.startswith("The following call raised this error"):
            text += "\n    " + "\n    ".join(x.strip() for x in lines[i + 1 : i + 3] if x.strip())
            break
    return text


def _capture_error(exc: Exception) -> CaptureError:
    message = str(exc)
    if isinstance(exc, GuardOnDataDependentSymNode) or "data-dependent" in message:
        hint = ("the forward branches, loops or sizes on tensor *values* (if x.sum() > 0, "
                ".item(), .tolist(), int(t)); make it shape-only, or use torch.where / "
                "torch.cond for value-dependent branches")
    elif "Unsupported input type" in message:
        hint = ("example inputs may be tensors, Python scalars and tuples/lists/dicts of them; "
                "register other classes with torch.export.register_dataclass")
    else:
        hint = ("torch.export (non-strict) runs forward on fake tensors; check that the example "
                "inputs have the shapes and dtypes forward expects and that forward uses no "
                "tensor data (numpy conversion, printing values)")
    return CaptureError("torch.export could not trace the model", reason=_first_lines(exc),
                        hint=hint)


__all__ = ["THIRD_PARTY_NOISE", "plain_outputs", "quiet_third_party", "quiet_torch_logs", "trace", "exported_to_aten",
           "exported_then_decomposed"]
