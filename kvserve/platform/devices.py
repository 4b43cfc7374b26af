"""Which devices this torch build can run kvserve on; checked before a model loads."""

from __future__ import annotations

import torch

KVSERVE_DEVICE_TYPES = ("cpu", "cuda")


def available_devices() -> list[str]:
    """The devices kvserve can run on with this torch, e.g. ['cpu'] or ['cpu', 'cuda:0', 'cuda:1']."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["cpu", *(f"cuda:{i}" for i in range(gpus))]


def check_device(device: str) -> None:
    """A ValueError naming ``device`` and what this torch supports, unless kvserve can run there."""
    torch_build = f"this torch ({torch.__version__})"
    supported = f"{torch_build} runs kvserve on: {', '.join(available_devices())}"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a device name; {supported}") from None
    if parsed.type not in KVSERVE_DEVICE_TYPES:
        kinds = " or ".join(KVSERVE_DEVICE_TYPES)
        raise ValueError(f"device {device!r} is not one kvserve runs on ({kinds}); {supported}")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        why = "is built without CUDA" if torch.version.cuda is None else "sees no CUDA GPU"
        raise ValueError(f"device {device!r} is not available: {torch_build} {why} and runs kvserve on: cpu")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} is not available: {supported}")
