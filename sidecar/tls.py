"""Mutually authenticated TLS 1.3 between walsidecar processes, from one certificates directory.

A certificates directory (made by `walsidecar certs create-node`) holds `ca.crt` (the
deployment's CA, or during a rotation a bundle of the old and the new one), `node.crt` and
`node.key`. Both ends present a certificate and accept only one signed by that CA; nothing
else (no system trust store) is trusted. What a peer may do follows from its role
(`peer_role`), which the CA wrote into its certificate (see sidecar/certs.py).
"""

from __future__ import annotations

import ipaddress
import ssl
from pathlib import Path
from typing import Any

from sidecar.certs import CA_CERT, NODE_CERT, NODE_KEY, ORGANIZATION, ROLES, Identity, make_commands

HANDSHAKE_TIMEOUT = 10.0  # seconds a connection may take to authenticate before it is dropped


class TlsError(Exception):
    """A certificates directory that cannot be used; the message says what is wrong."""


def server_context(certs_dir: Path) -> ssl.SSLContext:
    """For a listening safekeeper: TLS 1.3, and a client certificate from the CA is required."""
    ctx = _context(ssl.PROTOCOL_TLS_SERVER, certs_dir)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(certs_dir: Path) -> ssl.SSLContext:
    """For dialling a safekeeper: TLS 1.3, its certificate must come from the CA and name the host dialled."""
    ctx = _context(ssl.PROTOCOL_TLS_CLIENT, certs_dir)
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def https_context(certs_dir: Path) -> ssl.SSLContext:
    """For the read-only metrics endpoint: TLS with the node certificate; scrapers need none of their own."""
    ctx = _context(ssl.PROTOCOL_TLS_SERVER, certs_dir)
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def reader_port_context(certs_dir: Path) -> ssl.SSLContext:
    """For the reader port: TLS with the node certificate; a client certificate from the CA is asked for,
    not required (libpq readers log in with SCRAM), and only a proposer's may read above the commit."""
    ctx = _context(ssl.PROTOCOL_TLS_SERVER, certs_dir)
    ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


def server_end_point(certs_dir: Path) -> bytes:
    """RFC 5929 tls-server-end-point of the node certificate: its hash by its signature's hash, SHA-256 for
    MD5 and SHA-1, as SCRAM-SHA-256-PLUS clients (libpq channel_binding) compute it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    cert = x509.load_pem_x509_certificate(node_files(certs_dir)[1].read_bytes())
    algorithm = cert.signature_hash_algorithm
    if algorithm is None or isinstance(algorithm, (hashes.MD5, hashes.SHA1)):
        algorithm = hashes.SHA256()
    digest = hashes.Hash(algorithm)
    digest.update(cert.public_bytes(serialization.Encoding.DER))
    return digest.finalize()


def node_files(certs_dir: Path) -> tuple[Path, Path, Path]:
    """ca.crt, node.crt and node.key of a certificates directory; TlsError saying how to make missing ones."""
    paths = (certs_dir / CA_CERT, certs_dir / NODE_CERT, certs_dir / NODE_KEY)
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise TlsError(f"certificates directory {certs_dir} lacks {', '.join(missing)}; make it with\n  "
                       + make_commands(certs_dir=str(certs_dir)))
    return paths


def _context(protocol: int, certs_dir: Path) -> ssl.SSLContext:
    paths = node_files(certs_dir)
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    try:
        ctx.load_verify_locations(cafile=str(paths[0]))
        ctx.load_cert_chain(str(paths[1]), str(paths[2]))
    except (ssl.SSLError, OSError, ValueError) as e:
        raise TlsError(f"cannot use the certificates in {certs_dir}: {e}") from e
    return ctx


def identity_of(cert: dict[str, Any] | None) -> Identity | None:
    """The role (and safekeeper id) in a verified peer certificate as getpeercert() gives it."""
    if not cert:
        return None
    fields: dict[str, str] = {}
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            fields.setdefault(key, value)
    role = fields.get("organizationalUnitName")
    if fields.get("organizationName") != ORGANIZATION or role not in ROLES:
        return None
    if role != "safekeeper":
        return Identity(role)
    prefix, _, num = fields.get("commonName", "").partition("-")
    if prefix != "safekeeper" or not num.isdigit():
        return None
    return Identity(role, int(num))


def peer_role(transport_or_writer: Any) -> Identity | None:
    """Who the peer of a TLS connection is (None: not TLS, or no role we know)."""
    return identity_of(transport_or_writer.get_extra_info("peercert"))


def server_hostname(host: str) -> str:
    """The name to check a safekeeper's certificate against: the host as dialled."""
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return host
