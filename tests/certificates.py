"""Throwaway TLS certificates for tests, made by the ``openssl`` command: a CA and one server
certificate it signed for the given IP addresses (EC P-256, two days), with the extensions a
strict verifier asks for (Python's default context checks them)."""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Sequence
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Certificates:
    ca: Path
    cert: Path
    key: Path


def make_certificates(directory: Path, ips: Sequence[str] = ("127.0.0.1",)) -> Certificates:
    """A CA (``ca.pem``) and a certificate for ``ips`` (``gateway.pem``, key ``gateway.key`` 0600)."""
    directory.mkdir(parents=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=sandkernel test CA",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    openssl("req", *ec, "-keyout", "gateway.key", "-out", "gateway.csr", "-subj", f"/CN={ips[0]}")
    names = ",".join(f"IP:{ip}" for ip in ips)
    (directory / "leaf.cnf").write_text(
        f"subjectAltName={names}\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
    )
    openssl("x509", "-req", "-in", "gateway.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "gateway.pem", "-days", "2", "-extfile", "leaf.cnf")  # fmt: skip
    for name in ("gateway.key", "ca.key"):
        (directory / name).chmod(0o600)
    return Certificates(directory / "ca.pem", directory / "gateway.pem", directory / "gateway.key")
