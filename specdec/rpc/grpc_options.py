"""The gRPC channel arguments every server and channel of the service sets: message size bounds,
keepalive (a peer that stops answering pings is dropped, its calls cancelled), and how long an
idle or old connection may live.

gRPC's own defaults leave the send size unbounded, never ping, and keep connections forever: a
client that freezes mid-stream (a stopped process, a vanished machine) would hold its call, and
the request's KV-cache slots, until the request ends by itself. The router's and the workers'
values are documented in ``configs/default.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ConnectionLimits", "channel_options", "DEFAULT_MAX_MESSAGE_BYTES"]

DEFAULT_MAX_MESSAGE_BYTES = 4 << 20  # gRPC's default receive bound, now stated (and applied to sends)


def _ms(seconds: float) -> int:
    return max(1, int(round(seconds * 1000)))


@dataclass(frozen=True)
class ConnectionLimits:
    """What a server allows each connection.

    max_message_bytes: the largest message received or sent (RESOURCE_EXHAUSTED beyond).
    keepalive_time_s / keepalive_timeout_s: the server pings each connection this often and drops
      it when the ping is not answered in time (the peer is frozen or gone).
    max_connection_idle_s: a connection without a call for this long is closed (None: never).
    max_connection_age_s / max_connection_age_grace_s: a connection is told to go away after this
      long (GOAWAY: the client reconnects for new calls), and its calls still running get the
      grace period before the connection is closed (None: never).
    max_concurrent_streams: calls at once on one connection (None: gRPC's default).
    """

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    max_connection_idle_s: float | None = None
    max_connection_age_s: float | None = None
    max_connection_age_grace_s: float | None = None
    max_concurrent_streams: int | None = None

    def server_options(self) -> list[tuple[str, int]]:
        opts = [
            ("grpc.max_receive_message_length", int(self.max_message_bytes)),
            ("grpc.max_send_message_length", int(self.max_message_bytes)),
            ("grpc.keepalive_time_ms", _ms(self.keepalive_time_s)),
            ("grpc.keepalive_timeout_ms", _ms(self.keepalive_timeout_s)),
            # gRPC 1.85 drops a peer whose ping goes unanswered after this one; keepalive_timeout_ms
            # alone left a stopped client connected (tests/unit/test_grpc_options.py shows both)
            ("grpc.http2.ping_timeout_ms", _ms(self.keepalive_timeout_s)),
            # keep pinging while a stream is blocked (no data frames go out to a client that does not read)
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.keepalive_permit_without_calls", 1),
        ]
        if self.max_connection_idle_s is not None:
            opts.append(("grpc.max_connection_idle_ms", _ms(self.max_connection_idle_s)))
        if self.max_connection_age_s is not None:
            opts.append(("grpc.max_connection_age_ms", _ms(self.max_connection_age_s)))
        if self.max_connection_age_grace_s is not None:
            opts.append(("grpc.max_connection_age_grace_ms", _ms(self.max_connection_age_grace_s)))
        if self.max_concurrent_streams is not None:
            opts.append(("grpc.max_concurrent_streams", int(self.max_concurrent_streams)))
        return opts


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Size bounds for a client channel (what it sends and what it accepts)."""
    return [
        ("grpc.max_receive_message_length", int(max_message_bytes)),
        ("grpc.max_send_message_length", int(max_message_bytes)),
    ]
