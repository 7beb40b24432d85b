"""Throw-away TLS certificates for tests, made with the openssl command.

    certs = make_certificates(tmp_path)
    # certs.ca, certs.server_cert, certs.server_key, certs.client_cert, certs.client_key

A CA, a server certificate for localhost and 127.0.0.1, a client
certificate and a node certificate (for localhost and 127.0.0.1, good for
both ends of a call, as a cluster node's is), all signed by the CA (P-256
keys, valid for a day), as PEM files. A second, unrelated CA signs
`stranger_cert`, a node certificate the daemons must refuse.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    node_cert: Path
    node_key: Path
    stranger_cert: Path
    stranger_key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _authority(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN=kvd test {name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return cert, key


def _issue(directory: Path, name: str, authority: tuple[Path, Path], extensions: str) -> tuple[Path, Path]:
    cert, key, request = directory / f"{name}.pem", directory / f"{name}.key", directory / f"{name}.csr"
    extensions_file = directory / f"{name}.ext"
    extensions_file.write_text(extensions + "\nbasicConstraints=CA:FALSE\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(request), "-subj", f"/CN={name}")
    _openssl("x509", "-req", "-in", str(request), "-CA", str(authority[0]), "-CAkey", str(authority[1]),
             "-CAcreateserial", "-out", str(cert), "-days", "1", "-extfile", str(extensions_file))
    return cert, key


def make_certificates(directory: Path) -> Certificates:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    authority = _authority(directory, "ca")
    server = _issue(directory, "localhost", authority,
                    "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth")
    client = _issue(directory, "client", authority, "extendedKeyUsage=clientAuth")
    node_extensions = "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth"
    node = _issue(directory, "node", authority, node_extensions)
    stranger = _issue(directory, "stranger", _authority(directory, "other-ca"), node_extensions)
    return Certificates(authority[0], *server, *client, *node, *stranger)
