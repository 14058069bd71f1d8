"""``python -m specdec.rpc.health_probe``: exit 0 when a server's ``grpc.health.v1`` says SERVING.

For where Kubernetes' own ``grpc:`` probe cannot go: the kubelet speaks plaintext only, so once the
public port has TLS (or health needs a bearer token) k8s/specdec runs this as an exec probe in the
router container. Prints the status, or the gRPC error's code, and exits 1 unless SERVING.

``--ca`` may be given several times: the first file that exists is trusted (a TLS Secret's
``ca.crt`` when it has one, else its self-signed ``tls.crt``). ``--server-name`` is the name the
certificate is checked against when it is not the address's host (a probe dials 127.0.0.1).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.rpc.client_credentials import ClientCredentials

__all__ = ["check", "main"]


def check(address: str, service: str, creds: ClientCredentials, server_name: str | None, timeout: float) -> str:
    """The health status name of ``service`` ("" = the server), or the gRPC error's code name."""
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    with creds.channel(address, options) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.rpc.health_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--service", default="", help='health service name ("" = the whole server)')
    p.add_argument("--ca", action="append", default=[], metavar="PEM", help="TLS: CA to trust (the first that exists)")
    p.add_argument("--server-name", default=None, help="TLS: the name to check the certificate against")
    p.add_argument("--cert", default=None, metavar="PEM", help="mTLS: the probe's certificate")
    p.add_argument("--key", default=None, metavar="PEM", help="mTLS: ... and its key")
    p.add_argument("--token-file", default=None, metavar="FILE", help="bearer token: the file's first token")
    p.add_argument("--timeout", type=float, default=5.0)
    args = p.parse_args(argv)
    ca = next((c for c in args.ca if Path(c).is_file()), None)
    if args.ca and ca is None:
        print(f"none of the CA files exists: {', '.join(args.ca)}")
        return 1
    try:  # an unreadable certificate, key or token file: one line (service.sh prints it), not a trace
        creds = ClientCredentials.load(args.token_file, None, tls=bool(args.ca), ca=ca, cert=args.cert, key=args.key)
        status = check(args.address, args.service, creds, args.server_name, args.timeout)
    except (OSError, ValueError) as exc:
        print(f"probe not run: {exc}")
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
