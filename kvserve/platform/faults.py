"""Fault injection at named I/O points, for the fault tests and the chaos soak (``kvserve bench soak --chaos``).

The code that reads or writes a tier calls ``fault_point("swap")`` (and so on) just before the real I/O. With no
faults configured that is one dictionary lookup. ``KVSERVE_FAULTS`` arms points in a server started as a child
process: ``KVSERVE_FAULTS="swap=0.05,module-dir-write=0.5:ENOSPC"`` makes each call at ``swap`` raise
``OSError(EIO)`` with probability 0.05 and each ``module-dir-write`` raise ``OSError(ENOSPC)`` half of the time.
``KVSERVE_FAULTS_SEED`` seeds the draws. Tests arm points directly with ``inject_faults({...})``.

Points: ``swap`` (a preempted sequence's blocks copied to or from the host swap space), ``kv-disk`` (the offload
tier's transfers), ``module-dir-write`` / ``module-dir-read`` (Prompt Cache modules on ``--prompt-cache-dir``).
"""

from __future__ import annotations

import errno
import os
import random
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

POINTS = ("swap", "kv-disk", "module-dir-write", "module-dir-read")
ENV = "KVSERVE_FAULTS"
FAULT_MARK = "fault injected"  # in every injected error's message: a client can tell an injected fault's error

_lock = threading.Lock()
_armed: dict[str, tuple[float, int]] = {}  # point -> (probability, errno)
_rng = random.Random(0)
injected: Counter[str] = Counter()  # faults raised so far, by point


def parse_faults(spec: str) -> dict[str, tuple[float, int]]:
    """``"swap=0.05,module-dir-write=1:ENOSPC"`` -> {point: (probability, errno)}; a clear error otherwise."""
    armed = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        point, _, rest = item.partition("=")
        if point not in POINTS:
            raise ValueError(f"{ENV}: unknown fault point {point!r}; the points are {', '.join(POINTS)}")
        share, _, name = rest.partition(":")
        try:
            probability = float(share)
        except ValueError:
            raise ValueError(f"{ENV}: {item!r} needs a probability, as in {point}=0.05") from None
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"{ENV}: the probability of {point} must be in [0, 1], got {probability}")
        code = getattr(errno, name or "EIO", None)
        if not isinstance(code, int):
            raise ValueError(f"{ENV}: {name!r} is not an errno name (EIO, ENOSPC, EROFS, EACCES, ...)")
        armed[point] = (probability, code)
    return armed


def inject_faults(armed: dict[str, tuple[float, int] | float], seed: int = 0) -> None:
    """Arm points (a probability alone means EIO); an empty dict disarms every point."""
    with _lock:
        _armed.clear()
        for point, value in armed.items():
            if point not in POINTS:
                raise ValueError(f"unknown fault point {point!r}; the points are {', '.join(POINTS)}")
            _armed[point] = value if isinstance(value, tuple) else (float(value), errno.EIO)
        _rng.seed(seed)


@contextmanager
def faults(armed: dict[str, tuple[float, int] | float], seed: int = 0) -> Iterator[Counter[str]]:
    """Points armed for the ``with`` block; yields the counter of faults raised."""
    injected.clear()
    inject_faults(armed, seed)
    try:
        yield injected
    finally:
        inject_faults({})


def fault_point(point: str, what: str = "") -> None:
    """Raise the armed fault at ``point`` (with its probability), else nothing."""
    if not _armed:
        return
    with _lock:
        armed = _armed.get(point)
        if armed is None or _rng.random() >= armed[0]:
            return
        injected[point] += 1
    code = armed[1]
    raise OSError(code, f"{os.strerror(code)} ({FAULT_MARK} at {point})", what or None)


def _arm_from_environment() -> None:
    spec = os.environ.get(ENV, "")
    if spec:
        inject_faults(parse_faults(spec), int(os.environ.get(ENV + "_SEED", "0")))


_arm_from_environment()
