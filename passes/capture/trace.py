"""Tracing: ``torch.export`` (non-strict) plus functionalisation, with its failures as CaptureErrors.

:func:`trace` returns the exported program after ``run_decompositions({})`` (functional ATen that
keeps aten.linear, layer_norm, scaled_dot_product_attention, cross_entropy_loss, conv2d,
embedding, ... whole). A failed trace raises :class:`autopar.CaptureError` with the tracer's
first lines, the user's line that raised and a hint; torch's own logs, and third-party messages
the user cannot act on (:data:`THIRD_PARTY_NOISE`), stay quiet meanwhile.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import warnings

import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from autopar.core.errors import CaptureError


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


def trace(model, args, kwargs) -> torch.export.ExportedProgram:
    """``model(*args, **kwargs)`` exported (non-strict) and functionalised."""
    try:
        with quiet_torch_logs(), quiet_third_party():
            exported = torch.export.export(model, args, kwargs, strict=False)
    except Exception as exc:  # the tracer's failure becomes a CaptureError, chained
        raise _capture_error(exc) from exc
    try:
        with warnings.catch_warnings(), quiet_torch_logs():  # torch's deprecated pytree use while decomposing
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
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


__all__ = ["THIRD_PARTY_NOISE", "quiet_third_party", "quiet_torch_logs", "trace"]
