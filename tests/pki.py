"""Test certificates: a CA, a server certificate for localhost / 127.0.0.1 and a client certificate (TLS, mTLS)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

__all__ = ["make_pki"]


def make_pki(root: Path, server_name: str = "localhost") -> dict[str, Path]:
    """A CA, a server certificate for ``server_name`` (and 127.0.0.1) and a client certificate, all signed by the CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(subject: str, key, issuer_key, issuer: str, ca: bool, san: str | None = None):
        b = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(name(issuer))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san:
            names = [x509.DNSName(san), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            b = b.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    out = {}
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = cert("test-ca", ca_key, ca_key, "test-ca", ca=True)
    for role, san in (("server", server_name), ("client", None)):
        key = ec.generate_private_key(ec.SECP256R1())
        c = cert(role, key, ca_key, "test-ca", ca=False, san=san)
        out[f"{role}.key"] = root / f"{role}.key"
        out[f"{role}.key"].write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        out[f"{role}.crt"] = root / f"{role}.crt"
        out[f"{role}.crt"].write_bytes(c.public_bytes(serialization.Encoding.PEM))
    out["ca.crt"] = root / "ca.crt"
    out["ca.crt"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return out
