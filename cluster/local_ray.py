"""An embedded Ray cluster that listens on the loopback interface only.

Ray binds its GCS, raylet, agents and worker processes to the wildcard address unless the node's
IP is a loopback address, and ``ray.init(_node_ip_address="127.0.0.1")`` does not get one on
Linux: Ray swaps a loopback address for the machine's outward-facing IP
(``ray._private.services.resolve_ip_for_localhost``). It keeps the loopback address only where
it believes clusters are unsupported (its flag ``ray._private.ray_constants.ENABLE_RAY_CLUSTER``,
false on macOS and Windows, or with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` set before Ray is
imported). :func:`pin_loopback_node` clears that flag before the embedded cluster starts, so its
node IP is 127.0.0.1 and every Ray process binds 127.0.0.1 (measured with Ray 2.60:
tests/e2e/test_serve_e2e.py lists the sockets). Ray has no public option for it; the flag is
private, so it is set only if it exists and :func:`check_loopback` says so when it did not work.

A cluster joined with ``ray.address`` is not touched (its nodes must reach each other).
"""

from __future__ import annotations

import ipaddress
import logging

log = logging.getLogger(__name__)

__all__ = ["pin_loopback_node", "check_loopback", "is_loopback"]


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host.startswith("::ffff:"):
        host = host[len("::ffff:") :]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def pin_loopback_node() -> None:
    """Local clusters this process starts from now on get the node IP 127.0.0.1 (for the rest of
    the process: call it only where this process starts its own cluster)."""
    try:
        from ray._private import ray_constants
    except ImportError:  # pragma: no cover - a Ray without that module: check_loopback will say
        return
    if hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):
        ray_constants.ENABLE_RAY_CLUSTER = False


def check_loopback() -> str:
    """The running cluster's node IP; a warning when it is not a loopback address."""
    import ray

    ip = ray.util.get_node_ip_address()
    if not is_loopback(ip):
        log.warning(
            "the embedded Ray cluster's node IP is %s, not 127.0.0.1: its processes listen on every "
            "interface (Ray's token auth still refuses callers without the token)",
            ip,
        )
    return ip
