"""The deployment's certificate authority and the certificates of its processes.

A certificate says who its holder is in the subject: `O=walsidecar`, `OU=<role>` (proposer,
safekeeper or client) and `CN=<role>`, or `CN=safekeeper-<id>` for a safekeeper.
`ssl.SSLSocket.getpeercert()` shows both (see `sidecar.tls.peer_role`). The subject
alternative names list the DNS names and IP addresses the holder is reached at; a proposer
checks them against the address it dialled. Keys are EC P-256, written 0600 when created.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROLES = ("proposer", "safekeeper", "client")
ORGANIZATION = "walsidecar"
CA_CERT, CA_KEY = "ca.crt", "ca.key"
NODE_CERT, NODE_KEY = "node.crt", "node.key"
DEFAULT_HOSTS = ("localhost", "127.0.0.1")
CA_DAYS = 3650
NODE_DAYS = 825


class CertsError(Exception):
    """Certificates that cannot be made or used; the message says what to do."""


@dataclass(frozen=True)
class Identity:
    """Who a certificate names: a role, and for a safekeeper its id."""

    role: str
    id: int | None = None

    def __str__(self) -> str:
        return f"{self.role}-{self.id}" if self.id is not None else self.role


def make_commands(ca_dir: str = "CA", certs_dir: str = "DIR", role: str = "proposer|safekeeper|client") -> str:
    """The two commands that make a certificates directory, for error messages."""
    return (f"walsidecar certs create-ca --ca-dir {ca_dir}\n"
            f"  walsidecar certs create-node --ca-dir {ca_dir} --certs-dir {certs_dir} --role {role}")


def create_ca(ca_dir: Path, overwrite: bool = False, days: int = CA_DAYS) -> Path:
    """Write CA_DIR/ca.crt and CA_DIR/ca.key (0600); returns the certificate's path."""
    _refuse_existing([ca_dir / CA_CERT, ca_dir / CA_KEY], overwrite)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
                      x509.NameAttribute(NameOID.COMMON_NAME, "walsidecar CA")])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _mkdir(ca_dir)
    _write(ca_dir / CA_KEY, _key_pem(key), 0o600, overwrite)
    _write(ca_dir / CA_CERT, cert.public_bytes(serialization.Encoding.PEM), 0o644, overwrite)
    return ca_dir / CA_CERT


def create_node(ca_dir: Path, certs_dir: Path, role: str, node_id: int | None = None,
                hosts: tuple[str, ...] = (), overwrite: bool = False, days: int = NODE_DAYS) -> Identity:
    """Write CERTS_DIR/ca.crt, node.crt and node.key (0600), signed by the CA in CA_DIR."""
    ident = _identity(role, node_id)
    ca_cert, ca_key = load_ca(ca_dir)
    ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
    bundle = certs_dir / CA_CERT
    # A ca.crt that already trusts this CA stays as it is: during a rotation it holds both CAs.
    keep_bundle = bundle.exists() and ca_cert in _read_bundle(bundle)
    _refuse_existing([certs_dir / NODE_CERT, certs_dir / NODE_KEY] + ([] if keep_bundle else [bundle]), overwrite)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, ident.role),
                         x509.NameAttribute(NameOID.COMMON_NAME, str(ident))])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=True, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            # Every process may serve (a safekeeper, a metrics endpoint) and dial (the proposer, tools).
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(_sans(hosts or DEFAULT_HOSTS)), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]
                           critical=False)
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    _mkdir(certs_dir)
    _write(certs_dir / NODE_KEY, _key_pem(key), 0o600, overwrite)
    _write(certs_dir / NODE_CERT, cert.public_bytes(serialization.Encoding.PEM), 0o644, overwrite)
    if not keep_bundle:
        _write(bundle, ca_pem, 0o644, overwrite)
    return ident


def ensure_node(ca_dir: Path, certs_dir: Path, role: str, node_id: int | None = None,
                hosts: tuple[str, ...] = ()) -> Path:
    """A certificates directory for one process, made (with the CA) unless one from this CA is there."""
    if not (ca_dir / CA_CERT).exists():
        create_ca(ca_dir)
    there = all((certs_dir / n).exists() for n in (CA_CERT, NODE_CERT, NODE_KEY))
    if not there or load_ca(ca_dir)[0] not in _read_bundle(certs_dir / CA_CERT):
        create_node(ca_dir, certs_dir, role, node_id, hosts, overwrite=True)
    return certs_dir


def load_ca(ca_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = ca_dir / CA_CERT, ca_dir / CA_KEY
    if not cert_path.exists() or not key_path.exists():
        raise CertsError(f"no CA in {ca_dir} (it needs {CA_CERT} and {CA_KEY}): make one with "
                         f"`walsidecar certs create-ca --ca-dir {ca_dir}`")
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as e:
        raise CertsError(f"cannot read the CA in {ca_dir}: {e}") from e
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        raise CertsError(f"{key_path} is not the key of {cert_path}")
    return cert, key


def _identity(role: str, node_id: int | None) -> Identity:
    if role not in ROLES:
        raise CertsError(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")
    if role == "safekeeper":
        if node_id is None or node_id < 1:
            raise CertsError("a safekeeper certificate names the safekeeper's id: give --id N (its --id, 1 or more)")
        return Identity(role, node_id)
    if node_id is not None:
        raise CertsError(f"--id is for safekeeper certificates, not for a {role} certificate")
    return Identity(role)


def _sans(hosts: tuple[str, ...]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for h in hosts:
        h = h.strip().strip("[]")
        if not h:
            raise CertsError("--host must not be empty")
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            out.append(x509.DNSName(h))
    return out


def _read_bundle(path: Path) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(path.read_bytes())
    except (OSError, ValueError):
        return []


def _refuse_existing(paths: list[Path], overwrite: bool) -> None:
    there = [str(p) for p in paths if p.exists()]
    if there and not overwrite:
        raise CertsError(f"{', '.join(there)} already exist{'s' if len(there) == 1 else ''}: "
                         "nothing was written (give --overwrite to replace them)")


def _mkdir(d: Path) -> None:
    d.mkdir(mode=0o700, parents=True, exist_ok=True)


def _write(path: Path, data: bytes, mode: int, overwrite: bool) -> None:
    """Create `path` with `mode` from the start; with `overwrite`, replace it atomically."""
    target = path.with_name(path.name + ".new") if overwrite else path
    if overwrite:
        target.unlink(missing_ok=True)
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise CertsError(f"{path} already exists: nothing was written (give --overwrite to replace it)") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if overwrite:
        os.replace(target, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)
