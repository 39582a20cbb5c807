"""Numbers and names as the plan's texts and pictures print them: seconds, bytes, placements,
and names in natural order with numbered modules folded (``block.0-5.attn``)."""

from __future__ import annotations

import re

GiB = 1024**3


def fmt_time(s: float) -> str:
    """Seconds as ``1.234 s`` / ``12.35 ms`` / ``925.2 us``."""
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def fmt_time_short(s: float) -> str:
    """Seconds in at most 8 characters: ``1.234s`` / ``12.35ms`` / ``925.2us``."""
    return fmt_time(s).replace(" ", "")


def fmt_bytes(b: float) -> str:
    """Bytes in at most 6 characters: ``512B``, ``12.0K``, ``340M``, ``1.23G``, ``81.5G``."""
    for unit, scale in (("T", 1024**4), ("G", GiB), ("M", 1024**2), ("K", 1024)):
        if b >= scale:
            v = b / scale
            return f"{v:.2f}{unit}" if v < 10 else f"{v:.1f}{unit}" if v < 100 else f"{v:.0f}{unit}"
    return f"{b:.0f}B"


def fmt_placements(placements) -> str:
    return ",".join(placements)


def natural_key(text: str) -> tuple:
    """Sort key ordering the numbers in names by value: ``block.2`` before ``block.10``."""
    return tuple(int(t) if k % 2 else t for k, t in enumerate(re.split(r"(\d+)", text)))


def fold_numbered(names) -> list[str]:
    """Names that differ only in their first numbered part, for consecutive numbers, as one name,
    in natural order: ``[h.0.attn, h.1.attn, h.2.attn, h.5.attn, wte]`` ->
    ``[h.0-2.attn, h.5.attn, wte]`` (how the summary folds repeated layers)."""
    runs: dict[tuple, list[int]] = {}
    for name in names:
        parts = name.split(".")
        at = next((k for k, part in enumerate(parts) if part.isdigit()), None)
        if at is None:
            runs.setdefault((name,), [])
        else:
            runs.setdefault((".".join(parts[:at]), ".".join(parts[at + 1:])), []).append(int(parts[at]))
    out = []
    for key, numbers in runs.items():
        if not numbers:
            out.append(key[0])
            continue
        numbers.sort()
        start = prev = numbers[0]
        for n in numbers[1:] + [None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            span = str(start) if start == prev else f"{start}-{prev}"
            out.append(".".join(x for x in (key[0], span, key[1]) if x))
            if n is not None:
                start = prev = n
    return sorted(out, key=natural_key)


__all__ = ["GiB", "fmt_bytes", "fmt_placements", "fmt_time", "fmt_time_short", "fold_numbered", "natural_key"]
