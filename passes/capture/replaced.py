"""The model functions capture replaces while it traces (:mod:`autopar.passes.capture.scan`), so
that a replacement can hand a case it does not cover back to the model's own function."""

from __future__ import annotations

REPLACED: dict = {}  # (owner, name) -> (the model's own function, its replacement) while replaced


def own(replacement, owner=None):
    """The model's own function that ``replacement`` stands in for (on ``owner`` where given:
    a replacement installed on several classes or modules)."""
    return next(fn for (where, _), (fn, by) in REPLACED.items()
                if by is replacement and (owner is None or where is owner))


__all__ = ["REPLACED", "own"]
