"""What a rank stores for a parameter, buffer or constant placeholder: the program's state."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stored:
    """A parameter, buffer or constant placeholder and how it is stored."""

    node: str
    kind: str
    fqn: str
    sharding: tuple
    trainable: bool


__all__ = ["Stored"]
