"""Writing a file atomically with ordinary permissions (plans, pictures, the README's tables).

:func:`replacing` hands out a fresh temporary file next to the target and moves it over the
target only once it is complete, so a crash leaves the old file or none, never half of one.
The temporary file is created the way ``open(path, "w")`` creates a file, mode 0666 less the
user's umask (0644 under umask 022), not ``tempfile.mkstemp``'s private 0600.

    with replacing("plan.json") as tmp:
        Path(tmp).write_text(text)
"""

from __future__ import annotations

import contextlib
import os
import secrets


@contextlib.contextmanager
def replacing(path, *, suffix: str = ""):
    """Yield the path of a new empty file in ``path``'s folder; on a clean exit it replaces
    ``path``, on an exception it is removed (see the module docstring)."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}-{secrets.token_hex(4)}{suffix}")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text(path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically with ordinary permissions."""
    with replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)


__all__ = ["replacing", "write_text"]
