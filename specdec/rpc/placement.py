"""Where a worker computes, as one string the router compares: two workers with the same placement
share a device, so work on one (a draft worker's prefill) takes the other's time."""

from __future__ import annotations

import socket

from specdec.rpc.nvml import physical_index

__all__ = ["device_placement"]


def device_placement(device: str, visible: str | None = None) -> str:
    """The host name and device, "<host>/<device>": "cpu" for a CPU device (every process on the
    host shares its cores); for a CUDA device the GPU as the machine numbers it, "gpu<N>" or its
    UUID, through CUDA_VISIBLE_DEVICES (``visible``; default: this process's), which renumbers
    GPUs per process (Ray sets it for each actor)."""
    host = socket.gethostname()
    if not device.startswith("cuda"):
        return f"{host}/cpu"
    try:
        index, uuid = physical_index(device, visible)
    except ValueError:  # a device the process cannot see: it fails to load anyway
        return f"{host}/{device}"
    return f"{host}/{uuid}" if uuid is not None else f"{host}/gpu{index}"
