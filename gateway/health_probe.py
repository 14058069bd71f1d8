"""``python -m gateway.health_probe``: exit 0 when the gateway's ``GET /health`` answers 200.

For where Kubernetes' own ``httpGet`` probe cannot go: under mTLS the gateway's HTTPS port asks for
a client certificate, which the kubelet has none of, and with a token on health the router wants a
token the kubelet cannot read from a Secret; so k8s/specdec runs this as an exec probe in the
gateway container, with the certificate the gateway shows the router and the first token of the
tokens file. With ``--ca`` it speaks HTTPS and checks the gateway's certificate against that CA but
not against a host name (the probe dials the pod's own loopback, which no certificate names);
without, plain HTTP. Prints the status, or why there is none, and exits 1 unless 200.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import ssl
import sys

from specdec.rpc.client_credentials import ClientCredentials

__all__ = ["check", "main"]


def check(port: int, ca: str | None, cert: str | None, key: str | None, token: str | None, timeout: float) -> int:
    """The HTTP status of ``GET http(s)://127.0.0.1:<port>/health`` (HTTPS when ``ca`` is given)."""
    if ca:
        ctx = ssl.create_default_context(cafile=ca)
        ctx.check_hostname = False  # verify_mode stays CERT_REQUIRED: the chain is checked
        if cert:
            ctx.load_cert_chain(cert, key)
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=timeout, context=ctx)
    else:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/health", headers={"authorization": f"Bearer {token}"} if token else {})
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    try:
        print(json.loads(body).get("status", resp.status))
    except ValueError:
        print(resp.status)
    return resp.status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway.health_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--ca",
        action="append",
        default=[],
        metavar="PEM",
        help="HTTPS: the CA that signed the gateway's certificate; repeatable: the first file that exists",
    )
    p.add_argument("--cert", default=None, metavar="PEM", help="mTLS: the probe's certificate")
    p.add_argument("--key", default=None, metavar="PEM", help="mTLS: ... and its key")
    p.add_argument("--token-file", default=None, metavar="FILE", help="bearer token: the file's first token")
    p.add_argument("--timeout", type=float, default=5.0)
    args = p.parse_args(argv)
    ca = next((c for c in args.ca if os.path.isfile(c)), None)
    if args.ca and ca is None:
        print(f"none of the CA files exists: {', '.join(args.ca)}")
        return 1
    try:
        token = ClientCredentials.load(args.token_file, None).token if args.token_file else None
        return 0 if check(args.port, ca, args.cert, args.key, token, args.timeout) == 200 else 1
    except (OSError, ValueError, http.client.HTTPException) as exc:  # ssl.SSLError is an OSError
        print(f"no answer: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
