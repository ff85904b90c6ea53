"""The decode loop's crossings between host and device, each in one small function.

`host(t)` is the only device -> host transfer in a decode step, hence the only host sync: a drafted
token (one per draft step, see levels.Drafter) and a verification's verdict (one per verification, see
speculative.verify). Tests count its calls. Under torch.cuda.set_sync_debug_mode("error") any other
sync raises; host() lifts the mode for its own transfer only.

`to_device(t, device)` moves host token ids to the device without a sync: through pinned memory with a
non-blocking copy (torch's caching host allocator keeps the pinned block until the copy has run).
"""
from __future__ import annotations

import torch


def host(t: torch.Tensor) -> list:
    """t's values as Python numbers (t.tolist()): the one device -> host transfer."""
    if not t.is_cuda:
        return t.tolist()
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        return t.tolist()
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied without waiting for the device."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
