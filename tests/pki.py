"""Certificates for TLS tests, made here with `cryptography`: a CA, a server certificate it signs for the names
and addresses given, and another CA that signed nothing (a client trusting it must fail the handshake).

    files = make_pki(tmp_path, names=("fk-host2", "10.210.0.12"))   # {"ca", "other_ca", "cert", "key"}: PEM paths
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: str, issuer_key: ec.EllipticCurvePrivateKey,
          ca: bool, names: Sequence[str] = ()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder()
         .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
         .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if names:
        b = b.add_extension(x509.SubjectAlternativeName([_san(n) for n in names]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _pem(obj: x509.Certificate | ec.EllipticCurvePrivateKey) -> bytes:
    if isinstance(obj, x509.Certificate):
        return obj.public_bytes(serialization.Encoding.PEM)
    return obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_pki(out: Path, names: Sequence[str] = ("localhost", "127.0.0.1")) -> dict[str, str]:
    """ca.pem signs cert.pem (key.pem) for `names` (DNS names or IP addresses); other_ca.pem is a CA that signed
    nothing here. Returns the PEM paths by name."""
    out.mkdir(parents=True, exist_ok=True)
    ca_key, other_key, key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    files = {"ca": _cert("forkrl test CA", ca_key, "forkrl test CA", ca_key, True),
             "other_ca": _cert("another CA", other_key, "another CA", other_key, True),
             "cert": _cert("forkrl service", key, "forkrl test CA", ca_key, False, names), "key": key}
    paths = {}
    for name, obj in files.items():
        (out / f"{name}.pem").write_bytes(_pem(obj))
        paths[name] = str(out / f"{name}.pem")
    return paths
