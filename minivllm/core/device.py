"""Host values onto the device without waiting for it.

`torch.tensor(values, device="cuda")` copies from pageable memory and waits for the stream, which
would stall a host that schedules the next step while the device runs this one. Staging in pinned
(page-locked) memory lets the copy run asynchronously.
"""
import numpy as np
import torch


def to_device(values, dtype: torch.dtype | None, device: torch.device | str) -> torch.Tensor:
    """A host list or numpy array as a tensor on `device`, through pinned memory on CUDA.
    dtype None: a numpy array's own."""
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(np.ascontiguousarray(values))
        host = host if dtype is None else host.to(dtype)
    else:
        host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
