"""A throwaway PKI for TLS tests: a CA, a server certificate for 127.0.0.1/localhost, a client certificate."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _certificate(subject: str, key, issuer_name, issuer_key, is_ca: bool, usage, san=None):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name or name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if san is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


def _pem_pair(cert, key) -> tuple[bytes, bytes]:
    from cryptography.hazmat.primitives import serialization

    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def make_pki(directory: Path) -> dict[str, bytes]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, as PEM files (and bytes)."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca_key = _key()
    ca = _certificate("embedserv test CA", ca_key, None, None, is_ca=True, usage=None)
    server_key, client_key = _key(), _key()
    san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    server = _certificate(
        "localhost", server_key, ca.subject, ca_key, is_ca=False, usage=ExtendedKeyUsageOID.SERVER_AUTH, san=san
    )
    client = _certificate(
        "test client", client_key, ca.subject, ca_key, is_ca=False, usage=ExtendedKeyUsageOID.CLIENT_AUTH
    )
    pems = {"ca": _pem_pair(ca, ca_key)[0]}
    pems["server_cert"], pems["server_key"] = _pem_pair(server, server_key)
    pems["client_cert"], pems["client_key"] = _pem_pair(client, client_key)
    for name, data in pems.items():
        (directory / f"{name}.pem").write_bytes(data)
    return pems
