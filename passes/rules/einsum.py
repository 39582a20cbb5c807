"""Einsum equations as sharding rules: the options of one mesh axis, derived from the letters.

Every matmul-like op is an einsum (``mm`` is ``"ij,jk->ik"``, ``linear`` is ``"...i,oi->...o"``).
On one mesh axis an einsum can

- shard a letter kept in the output: each operand holding that letter shards its dim (an operand
  that broadcasts it, size 1, stays replicated) and the output is sharded on it;
- shard a contracted letter: the operands holding it shard it and the output is ``Partial(sum)``;
- pass a ``Partial`` through: one operand ``Partial``, the others replicated, gives a ``Partial``
  output (einsum is linear in each operand; two ``Partial`` operands multiplied never are).

    >>> eq = parse_equation("bsh,oh->bso", ndims=(3, 2))
    >>> [str(o) for o in einsum_options(eq, shapes=((8, 4, 16), (8, 16)), partial_inputs=False)]
    ['S(0),R->S(0)', 'S(1),R->S(1)', 'R,S(0)->S(2)', 'S(2),S(1)->P(sum)']

A letter repeated inside one operand (a diagonal) is never sharded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from autopar.core.errors import ShardingError
from autopar.core.placement import P, Placement, R, Shard

_ELLIPSIS = "..."


@dataclass(frozen=True)
class Equation:
    """A parsed einsum equation: one label per dim of each operand and of the output.

    Letters are their own labels; the dims an ellipsis stands for are labelled ``"…0"``,
    ``"…1"``, ... counted in the broadcast frame (the longest ellipsis), right-aligned.
    """

    inputs: tuple[tuple[str, ...], ...]
    output: tuple[str, ...]

    def __post_init__(self):
        known = {label for operand in self.inputs for label in operand}
        for label in self.output:
            if label not in known:
                raise ShardingError(f"einsum output label {label!r} is in no operand: {self}")
        if len(set(self.output)) != len(self.output):
            raise ShardingError(f"einsum output repeats a label: {self}")

    def __str__(self) -> str:
        ins = ",".join(" ".join(op) for op in self.inputs)
        return f"{ins} -> {' '.join(self.output)}"


def _split_operand(text: str) -> tuple[list[str], bool]:
    """Letters of one operand's subscript; the ellipsis is the marker ``_ELLIPSIS``."""
    text = text.replace(" ", "")
    if text.count(_ELLIPSIS) > 1:
        raise ShardingError(f"einsum subscript {text!r} has more than one '...'")
    labels: list[str] = []
    rest = text
    while rest:
        if rest.startswith(_ELLIPSIS):
            labels.append(_ELLIPSIS)
            rest = rest[3:]
        elif rest[0].isalpha():
            labels.append(rest[0])
            rest = rest[1:]
        else:
            raise ShardingError(f"einsum subscript {text!r}: {rest[0]!r} is not a letter or '...'")
    return labels, _ELLIPSIS in labels


def _expand(labels: list[str], ellipsis_rank: int, frame: int) -> tuple[str, ...]:
    out: list[str] = []
    for label in labels:
        if label == _ELLIPSIS:
            out.extend(f"…{frame - ellipsis_rank + j}" for j in range(ellipsis_rank))
        else:
            out.append(label)
    return tuple(out)


def parse_equation(equation: str, *, ndims: Sequence[int]) -> Equation:
    """Parse ``equation`` for operands of ranks ``ndims``, expanding ``...`` and an implicit output."""
    if "->" in equation:
        lhs, rhs = equation.split("->", 1)
    else:
        lhs, rhs = equation, None
    operands = [_split_operand(part) for part in lhs.split(",")]
    if len(operands) != len(ndims):
        raise ShardingError(
            f"einsum {equation!r} names {len(operands)} operands but {len(ndims)} tensors were given"
        )
    ranks = []
    for (labels, has_ellipsis), ndim in zip(operands, ndims):
        named = len(labels) - has_ellipsis
        rank = ndim - named
        if rank < 0 or (rank > 0 and not has_ellipsis):
            raise ShardingError(
                f"einsum {equation!r}: subscript {''.join(labels)!r} does not match a tensor of"
                f" {ndim} dims; fix the equation or the operand"
            )
        ranks.append(rank)
    frame = max(ranks, default=0)
    inputs = tuple(_expand(labels, rank, frame) for (labels, _), rank in zip(operands, ranks))
    if rhs is None:
        counts: dict[str, int] = {}
        for operand in inputs:
            for label in operand:
                counts[label] = counts.get(label, 0) + 1
        ell = [f"…{j}" for j in range(frame) if any(f"…{j}" in op for op in inputs)]
        letters = sorted(lab for lab, c in counts.items() if c == 1 and not lab.startswith("…"))
        output = tuple(ell + letters)
    else:
        out_labels, _ = _split_operand(rhs)
        output = _expand(out_labels, frame, frame)
    return Equation(inputs, output)


@dataclass(frozen=True)
class EinsumOption:
    """One mesh axis of an einsum: a placement per operand and one for the output."""

    operands: tuple[Placement, ...]
    output: Placement

    def __str__(self) -> str:
        return ",".join(str(p) for p in self.operands) + f"->{self.output}"


def label_sizes(equation: Equation, shapes: Sequence[Sequence[int]]) -> dict[str, int]:
    """Size of every label after broadcasting (size-1 dims stretch to the others)."""
    sizes: dict[str, int] = {}
    for labels, shape in zip(equation.inputs, shapes):
        if len(labels) != len(shape):
            raise ShardingError(f"einsum operand of shape {tuple(shape)} does not match {labels}")
        for label, size in zip(labels, shape):
            old = sizes.get(label, 1)
            if old != size and 1 not in (old, size):
                raise ShardingError(f"einsum label {label!r} has sizes {old} and {size}")
            sizes[label] = max(old, size)
    return sizes


def einsum_options(
    equation: Equation, *, shapes: Sequence[Sequence[int]], partial_inputs: bool
) -> list[EinsumOption]:
    """The one-axis options of ``equation`` on operands of ``shapes`` (replicated not included).

    ``partial_inputs`` adds the options that take one operand ``Partial`` (use it for floating
    point operands only). Options whose shards do not divide evenly are left to the registry.
    """
    sizes = label_sizes(equation, shapes)
    options: list[EinsumOption] = []
    labels = list(equation.output) + sorted(
        {lab for op in equation.inputs for lab in op} - set(equation.output)
    )
    for label in labels:
        if sizes[label] == 1:
            continue
        if any(op.count(label) > 1 for op in equation.inputs):
            continue  # a diagonal: its two dims cannot be split by one placement
        placements = []
        for op, shape in zip(equation.inputs, shapes):
            if label in op and shape[op.index(label)] == sizes[label]:
                placements.append(Shard(op.index(label)))
            else:
                placements.append(R)  # absent, or broadcast from size 1
        out = Shard(equation.output.index(label)) if label in equation.output else P
        options.append(EinsumOption(tuple(placements), out))
    if partial_inputs:
        n = len(equation.inputs)
        for i in range(n):
            options.append(EinsumOption(tuple(P if j == i else R for j in range(n)), P))
    return options


def addend_placement(out: Placement, *, addend_shape: Sequence[int], out_shape: Sequence[int]) -> Placement:
    """Placement of a term added to an einsum's output (a bias), broadcast right-aligned.

    A ``Partial`` output needs a ``Partial`` addend (a replicated one would be added on every
    rank and counted once per rank); a sharded output dim the addend broadcasts stays replicated.
    """
    if isinstance(out, Shard):
        dim = out.dim - (len(out_shape) - len(addend_shape))
        if dim >= 0 and addend_shape[dim] == out_shape[out.dim]:
            return Shard(dim)
        return R
    return out


__all__ = ["EinsumOption", "Equation", "addend_placement", "einsum_options", "label_sizes", "parse_equation"]
