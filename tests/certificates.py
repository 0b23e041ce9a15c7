"""Certificates for the TLS tests, made with the openssl command."""

from __future__ import annotations

import subprocess
from pathlib import Path


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


def make_certificates(directory: Path, common_name: str, subject_alt_name: str) -> dict[str, str]:
    """A CA and one certificate signed by it (for server and client use), valid for
    `subject_alt_name` ("IP:127.0.0.1,DNS:localhost", say): paths under `cert`, `key`, `ca`."""
    ca_key, ca, key, csr, cert = (str(directory / n) for n in ("ca.key", "ca.pem", "svc.key", "svc.csr", "svc.pem"))
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "1", "-subj", "/CN=test-ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", f"/CN={common_name}")
    ext = directory / "ext.cnf"
    ext.write_text(f"subjectAltName={subject_alt_name}\nextendedKeyUsage=serverAuth,clientAuth\n")
    openssl(
        "x509",
        "-req",
        "-in",
        csr,
        "-CA",
        ca,
        "-CAkey",
        ca_key,
        "-CAcreateserial",
        "-out",
        cert,
        "-days",
        "1",
        "-extfile",
        str(ext),
    )
    return {"cert": cert, "key": key, "ca": ca}
