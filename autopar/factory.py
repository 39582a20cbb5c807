"""Model factories for the command line: ``autopar plan FILE.py:NAME`` or ``MODULE:NAME``.

A factory is a function (called with the ``--arg KEY=VALUE`` keywords) that returns one of:

- ``(model, example_inputs)`` — the model computes its own loss (a 0-dim output or ``.loss``);
- ``(model, example_inputs, loss_fn, example_target)`` — the loss is ``loss_fn(model(...), target)``;
- a dict with keys ``model``, ``example_inputs`` and optionally ``loss_fn``, ``example_target``.

``example_inputs`` is what :func:`autopar.compile` takes (a tuple of positional arguments or a
dict of keyword arguments) or, as :mod:`autopar.zoo` factories return it, ``(args, kwargs)``: a
tuple and a dict. Positional arguments are named after ``model.forward``'s parameters (the plan
calls the inputs what ``forward`` calls them), so that ``autopar plan autopar.zoo:gpt2`` works as
it is.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from autopar.core.errors import AutoparError


class FactoryError(AutoparError, ValueError):
    """A model factory cannot be found, called, or returned something autopar cannot plan."""


@dataclass(frozen=True)
class ModelSpec:
    """What a factory built: the arguments :func:`autopar.compile` needs."""

    model: nn.Module
    example_inputs: Any
    loss_fn: Callable | None = None
    example_target: Any = None

    def compile_kwargs(self) -> dict:
        return dict(example_inputs=self.example_inputs, loss_fn=self.loss_fn,
                    example_target=self.example_target)


def parse_arg(text: str) -> tuple[str, Any]:
    """``"layers=4"`` -> ``("layers", 4)``; values are Python literals, else strings."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise FactoryError(f"factory arguments are KEY=VALUE with KEY a Python name, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def load_factory(spec: str) -> Callable:
    """The function ``spec`` names: ``path/to/file.py:name`` or ``package.module:name``."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise FactoryError(f"a factory is FILE.py:NAME or MODULE:NAME (e.g. autopar.zoo:gpt2), got {spec!r}")
    if where.endswith(".py") or os.sep in where:
        if not os.path.isfile(where):
            raise FactoryError(f"no such file: {where} (from factory {spec!r})")
        mod_name = "autopar_factory_" + os.path.splitext(os.path.basename(where))[0]
        loader_spec = importlib.util.spec_from_file_location(mod_name, where)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[mod_name] = module
        loader_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            raise FactoryError(f"cannot import module {where!r} (from factory {spec!r}): {exc}") from exc
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        found = factories(module)
        close = difflib.get_close_matches(name, found, n=1)
        raise FactoryError(f"{where} has no function {name!r}"
                           + (f" (did you mean {close[0]!r}?)" if close else "") + "; "
                           + (f"factories there: {', '.join(found)}" if found else "it defines no factory function"))
    return fn


def _may_return_a_model(fn) -> bool:
    """Whether ``fn``'s return annotation (a string under postponed annotations) allows a model:
    absent, or naming a Module, a tuple or a dict."""
    annotation = inspect.signature(fn).return_annotation
    if annotation is inspect.Signature.empty:
        return True
    text = annotation if isinstance(annotation, str) else repr(annotation)
    return any(word in text for word in ("Module", "tuple", "Tuple", "dict", "Dict"))


def factories(module) -> list[str]:
    """The public functions ``module`` defines (not imports) that may return a model, sorted:
    what ``autopar plan MODULE:NAME`` can name. Classes, exceptions and functions annotated to
    return something else (a config) are left out."""
    return sorted(k for k, v in vars(module).items()
                  if inspect.isfunction(v) and not k.startswith("_") and v.__module__ == module.__name__
                  and _may_return_a_model(v))


def _name_positional(model: nn.Module, args: tuple, kwargs: dict):
    """``(args, kwargs)`` as one dict keyed by ``model.forward``'s parameter names, so that inputs
    keep those names in the plan; positional-only or ``*args`` inputs stay a tuple (without
    keyword inputs: compile takes one or the other)."""
    if not args:
        return dict(kwargs)
    signature = inspect.signature(model.forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise FactoryError(f"the factory's example inputs do not fit {type(model).__name__}.forward: {exc}") from exc
    out = {}
    for pname, value in bound.arguments.items():
        kind = signature.parameters[pname].kind
        if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY):
            if kwargs:
                raise FactoryError(f"{type(model).__name__}.forward takes {pname!r} only by position: pass"
                                   " its inputs as a tuple of positional arguments without keyword arguments")
            return tuple(args)
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[pname] = value
    return out


def _normalise_inputs(model, inputs):
    if (isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[0], (tuple, list))
            and isinstance(inputs[1], dict)):
        return _name_positional(model, tuple(inputs[0]), inputs[1])
    if isinstance(inputs, torch.Tensor):
        return _name_positional(model, (inputs,), {})
    if isinstance(inputs, (tuple, list)):
        return _name_positional(model, tuple(inputs), {})
    if isinstance(inputs, dict):
        return inputs
    raise FactoryError(f"example_inputs must be a tuple, a dict or (args, kwargs), got {type(inputs).__name__}")


def build(spec: str, kwargs: dict | None = None) -> ModelSpec:
    """Load the factory ``spec``, call it with ``kwargs`` and check what it returns."""
    fn = load_factory(spec)
    kwargs = dict(kwargs or {})
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError as exc:
        raise FactoryError(f"{spec} does not take the arguments {kwargs}: {exc}") from exc
    except ValueError:  # no signature (a builtin): let the call itself decide
        pass
    out = fn(**kwargs)
    if isinstance(out, dict):
        missing = {"model", "example_inputs"} - set(out)
        if missing:
            raise FactoryError(f"{spec} returned a dict without {sorted(missing)}")
        model, inputs, loss_fn, target = out["model"], out["example_inputs"], out.get("loss_fn"), out.get("example_target")
    elif isinstance(out, tuple) and len(out) in (2, 4):
        model, inputs = out[:2]
        loss_fn, target = out[2:] if len(out) == 4 else (None, None)
    else:
        raise FactoryError(f"{spec} must return (model, example_inputs) or (model, example_inputs, loss_fn,"
                           f" example_target), got {type(out).__name__}"
                           + (f" of length {len(out)}" if isinstance(out, tuple) else ""))
    if not isinstance(model, nn.Module):
        raise FactoryError(f"{spec} returned {type(model).__name__} where an nn.Module was expected")
    if loss_fn is not None and not callable(loss_fn):
        raise FactoryError(f"{spec} returned a loss_fn that is not callable: {type(loss_fn).__name__}")
    return ModelSpec(model, _normalise_inputs(model, inputs), loss_fn, target)


__all__ = ["FactoryError", "ModelSpec", "build", "factories", "load_factory", "parse_arg"]
