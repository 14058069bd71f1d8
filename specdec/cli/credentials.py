"""The flags a client command takes to reach a server with TLS and bearer tokens
(`specdec generate --server`, `specdec bench serve`), and the ones `specdec serve` takes to ask
for them. grpc is imported only when the credentials are built."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_client_credential_args", "client_credentials", "add_server_security_args", "security_overrides"]


def add_client_credential_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server credentials (TLS, bearer token)")
    g.add_argument("--token-file", default=None, metavar="FILE", help="bearer token: the file's first line")
    g.add_argument(
        "--token-env",
        default="SPECDEC_API_TOKEN",
        metavar="VAR",
        help="bearer token from this environment variable when it is set (default: SPECDEC_API_TOKEN)",
    )
    g.add_argument("--tls", action="store_true", help="TLS, trusting the system's CAs (implied by --ca / --cert)")
    g.add_argument("--ca", default=None, metavar="PEM", help="TLS: the CA certificate to trust")
    g.add_argument("--cert", default=None, metavar="PEM", help="mTLS: this client's certificate")
    g.add_argument("--key", default=None, metavar="PEM", help="mTLS: this client's private key")


def client_credentials(args: argparse.Namespace):
    """A :class:`specdec.rpc.client_credentials.ClientCredentials` from the flags (ValueError/OSError if bad)."""
    from specdec.rpc.client_credentials import ClientCredentials

    return ClientCredentials.load(
        args.token_file, args.token_env, tls=args.tls, ca=args.ca, cert=args.cert, key=args.key
    )


def add_server_security_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security (override the config's `security` section)")
    g.add_argument("--tls-cert", default=None, metavar="PEM", help="TLS on the public port: the server certificate")
    g.add_argument("--tls-key", default=None, metavar="PEM", help="... and its private key")
    g.add_argument("--tls-client-ca", default=None, metavar="PEM", help="mTLS: clients need a certificate it signed")
    g.add_argument("--tokens-file", default=None, metavar="FILE", help="bearer tokens accepted, one per line")
    g.add_argument("--tokens-env", default=None, metavar="VAR", help="... or comma-separated in this variable")
    g.add_argument(
        "--exempt",
        default=None,
        metavar="LIST",
        help="methods open without a token: comma-separated of health, reflection ('' = none; default: health)",
    )
    g.add_argument(
        "--worker-secret-file",
        default=None,
        metavar="FILE",
        help="router <-> worker shared secret (default: a fresh one per start)",
    )


def security_overrides(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("tls_cert", "tls_key", "tls_client_ca", "tokens_file", "tokens_env", "worker_secret_file")
    out: dict[str, Any] = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    if args.exempt is not None:
        out["exempt"] = [e.strip() for e in args.exempt.split(",") if e.strip()]
    return out
