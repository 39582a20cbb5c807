"""Calibration: fits of measured times to the cost models, and the on-disk profile database.

The profiler (:mod:`autopar.profiler`) measures; this module turns measurements into model
constants and stores them. The database is one JSON file, ``profiles.json`` in the cache
directory (``$AUTOPAR_CACHE_DIR``, else ``~/.cache/autopar``), keyed by device and world size::

    {"version": 1, "entries": {"cpu:Intel Xeon...:1t|world=2": {"device": {...},
                                                                "collectives": [...], ...}}}

Fits minimise *relative* squared error with non-negative coefficients, so small and large sizes
weigh alike and a noisy point cannot make a latency or a bandwidth negative.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autopar.core.errors import ClusterError
from autopar.cost_models.communication import CollectiveFit, Link, bus_factor, latency_steps
from autopar.cost_models.devices import DeviceSpec

DB_VERSION = 1
DB_FILENAME = "profiles.json"


def default_cache_dir() -> Path:
    """``$AUTOPAR_CACHE_DIR`` if set, else ``~/.cache/autopar``."""
    env = os.environ.get("AUTOPAR_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "autopar"


def local_device_key(threads: int) -> str:
    """Database key of this machine's CPU used with ``threads`` threads per rank."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu:{model}:{threads}t"


def gpu_device_key(device_name: str) -> str:
    """Database key of a GPU type, by its spec name (``"gpu:H100-80GB"``)."""
    return f"gpu:{device_name}"


def entry_key(device_key: str, world_size: int) -> str:
    return f"{device_key}|world={world_size}"


def read_database(cache_dir=None) -> dict:
    """The whole database (empty if there is none); raises ClusterError on a corrupt file."""
    path = Path(cache_dir or default_cache_dir()) / DB_FILENAME
    if not path.exists():
        return {"version": DB_VERSION, "entries": {}}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ClusterError(f"profile database {path} is not valid JSON ({exc}); delete it and run"
                           " `autopar profile` again") from exc
    if data.get("version") != DB_VERSION:
        return {"version": DB_VERSION, "entries": {}}
    return data


def write_entry(key: str, entry: dict, cache_dir=None) -> Path:
    """Add or replace one entry; the file is replaced atomically (write to a temp file, rename)."""
    directory = Path(cache_dir or default_cache_dir())
    directory.mkdir(parents=True, exist_ok=True)
    data = read_database(directory)
    data["entries"][key] = entry
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".profiles.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=1, sort_keys=True)
        os.replace(tmp, directory / DB_FILENAME)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return directory / DB_FILENAME


def fit_nonnegative(features, seconds) -> np.ndarray:
    """Coefficients ``c >= 0`` minimising ``sum(((features @ c - t) / t)**2)``.

    Exhaustive over the active set (a handful of columns), so it is exact and dependency-free.
    """
    a = np.asarray(features, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if a.ndim != 2 or len(t) != a.shape[0] or len(t) < a.shape[1]:
        raise ClusterError(f"need at least {a.shape[1]} measurements to fit, got {len(t)}")
    aw, tw = a / t[:, None], np.ones_like(t)
    best, best_err = None, np.inf
    cols = range(a.shape[1])
    for r in range(1, a.shape[1] + 1):
        for subset in itertools.combinations(cols, r):
            coef, *_ = np.linalg.lstsq(aw[:, subset], tw, rcond=None)
            if np.any(coef < 0):
                continue
            full = np.zeros(a.shape[1])
            full[list(subset)] = coef
            err = float(np.sum((aw @ full - tw) ** 2))
            if err < best_err:
                best, best_err = full, err
    if best is None:
        raise ClusterError("could not fit non-negative constants to the measurements")
    return best


def fit_alpha_beta(nbytes, seconds) -> tuple[float, float]:
    """``(alpha, beta)`` with ``seconds ~ alpha + beta * nbytes``; needs a positive beta."""
    alpha, beta = fit_nonnegative(np.column_stack([np.ones(len(nbytes)), nbytes]), seconds)
    if beta <= 0:
        raise ClusterError("measured times do not grow with size; measure larger sizes")
    return float(alpha), float(beta)


def link_from_fit(fit: CollectiveFit) -> Link:
    """The per-step latency and bandwidth that reproduce ``fit`` under the ring formulas."""
    n = fit.group_size
    return Link(bandwidth=bus_factor(fit.kind, n) / fit.beta,
                latency=fit.alpha / latency_steps(fit.kind, n))


@dataclass(frozen=True)
class Calibration:
    """Measured constants for one device and world size: a calibrated :class:`DeviceSpec` and the
    fitted collectives. ``link(level)`` derives a link from the all-reduce fit for sizes and kinds
    that were not measured."""

    key: str
    device: DeviceSpec | None = None
    collectives: tuple[CollectiveFit, ...] = ()
    host_link_bandwidth: float | None = None  # bytes/s of one device's copies to/from the host
    host_step_rate: float | None = None  # Adam parameters/s the host steps for one device

    def __post_init__(self):
        object.__setattr__(self, "collectives", tuple(self.collectives))

    def collective_fit(self, kind: str, group_size: int, level: str) -> CollectiveFit | None:
        for fit in self.collectives:
            if (fit.kind, fit.group_size, fit.level) == (kind, group_size, level):
                return fit
        return None

    def link(self, level: str) -> Link | None:
        fits = [f for f in self.collectives if f.level == level and f.kind == "all_reduce"]
        if not fits:
            return None
        return link_from_fit(max(fits, key=lambda f: f.group_size))

    def to_dict(self) -> dict:
        return {
            "key": self.key,
            "device": self.device.to_dict() if self.device else None,
            "collectives": [
                {"kind": f.kind, "group_size": f.group_size, "level": f.level, "alpha": f.alpha,
                 "beta": f.beta} for f in self.collectives
            ],
            "host_link_bandwidth": self.host_link_bandwidth,
            "host_step_rate": self.host_step_rate,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Calibration":
        fits = tuple(
            CollectiveFit(c["kind"], int(c["group_size"]), c["level"], float(c["alpha"]), float(c["beta"]))
            for c in data.get("collectives", ())
        )
        device = DeviceSpec.from_dict(data["device"]) if data.get("device") else None
        return cls(key=data["key"], device=device, collectives=fits,
                   host_link_bandwidth=data.get("host_link_bandwidth"), host_step_rate=data.get("host_step_rate"))


def load_calibration(device_key: str, world_size: int, *, cache_dir=None) -> Calibration | None:
    """The stored calibration for ``device_key`` and ``world_size``, or None."""
    key = entry_key(device_key, world_size)
    entry = read_database(cache_dir)["entries"].get(key)
    return Calibration.from_dict(entry["calibration"]) if entry else None


__all__ = [
    "Calibration",
    "default_cache_dir",
    "entry_key",
    "fit_alpha_beta",
    "fit_nonnegative",
    "gpu_device_key",
    "link_from_fit",
    "load_calibration",
    "local_device_key",
    "read_database",
    "write_entry",
]
