"""``python -m gateway``: the OpenAI-compatible HTTP API in its own process (``specdec serve`` starts
it beside the router; on Kubernetes it is its own container). uvicorn serves the app; TLS and mTLS
take the same PEM files as the gRPC port (README, Security)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import ssl
import threading
import time

import uvicorn

from gateway.app import GatewayConfig, create_app
from specdec.core.log_format import LOG_FORMATS, TEXT_FORMAT, set_log_format
from specdec.rpc.client_credentials import ClientCredentials


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    p.add_argument("--router", default="127.0.0.1:50051", help="the router's gRPC address")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--tls-cert", default=None, help="HTTPS: the server certificate (PEM)")
    p.add_argument("--tls-key", default=None, help="HTTPS: its private key (PEM)")
    p.add_argument("--tls-client-ca", default=None, help="mTLS: require client certificates signed by this CA")
    p.add_argument("--router-tls", action="store_true", help="reach the router over TLS (system roots)")
    p.add_argument(
        "--router-ca",
        action="append",
        default=[],
        metavar="PEM",
        help="reach the router over TLS, trusting this CA; repeatable: the first file that exists (a TLS "
        "Secret's ca.crt when it has one, else its self-signed tls.crt)",
    )
    p.add_argument(
        "--router-server-name", default=None, help="TLS: the name the router's certificate has, if not its host"
    )
    p.add_argument("--router-cert", default=None, help="mTLS to the router: the gateway's certificate")
    p.add_argument("--router-key", default=None, help="mTLS to the router: its key")
    p.add_argument("--timeout", type=float, default=None, help="deadline per request, seconds (default none)")
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--log-format", choices=LOG_FORMATS, default="text", help="text lines or JSON objects, as specdec serve's"
    )
    p.add_argument("--exit-with-parent", type=int, default=None, metavar="PID", help="stop when process PID is gone")
    args = p.parse_args(argv)
    if args.router_ca:
        found = next((c for c in args.router_ca if os.path.isfile(c)), None)
        if found is None:
            p.error(f"--router-ca: none of these files exists: {', '.join(args.router_ca)}")
        args.router_ca = found
    else:
        args.router_ca = None
    if bool(args.tls_cert) != bool(args.tls_key):
        p.error("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        p.error("--tls-client-ca (mTLS) needs --tls-cert and --tls-key")
    return args


def exit_with_parent(pid: int, period_s: float = 0.5) -> None:
    """SIGTERM this process once ``pid`` is no longer its parent: `specdec serve` killed outright (or
    its Ray driver aborted) must not leave the gateway serving a router that is gone."""

    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(period_s)
        logging.getLogger(__name__).warning("gateway: parent process %d is gone: stopping", pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=TEXT_FORMAT)
    set_log_format(args.log_format)
    if args.exit_with_parent is not None:
        exit_with_parent(args.exit_with_parent)
    credentials = ClientCredentials(
        token=None, tls=args.router_tls, ca=args.router_ca, cert=args.router_cert, key=args.router_key
    )
    config = GatewayConfig(
        router=args.router, credentials=credentials, timeout=args.timeout, router_server_name=args.router_server_name
    )
    app = create_app(config)
    tls = {}
    if args.tls_cert:
        tls = {"ssl_certfile": args.tls_cert, "ssl_keyfile": args.tls_key}
        if args.tls_client_ca:
            tls.update(ssl_ca_certs=args.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    # uvicorn's access log off: the router writes the one access line per request (router/access_log.py),
    # the gateway only that of a request it refuses itself (gateway/access.py)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False, **tls)


if __name__ == "__main__":
    main()
