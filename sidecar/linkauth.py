"""`--link-security auth-only`: both ends of a link prove their certificate, and nothing is encrypted.

A challenge-response at connection start, as SCRAM does it, with the keys and certificates of
`--certs-dir`. The safekeeper sends `AuthChallenge`: 32 random bytes and its certificate. The dialler
checks that certificate (the deployment's CA, a name of the host it dialled), then answers with
`AuthResponse`: its certificate, a nonce of its own, the host and port it dialled and an ECDSA
signature over the `transcript`: both certificates, both nonces, that host and port and both roles,
as TLS 1.3's CertificateVerify covers the handshake. The safekeeper checks the certificate against its
`ca.crt` bundle, its validity, the signature, that the host is one of its own names and the port the
one the connection arrived on, then proves itself over the same transcript with `AuthConfirm`.

So a proof is good for one safekeeper's address only: whoever the dialler reached cannot pass its
proof on to another safekeeper sharing the host name (a relay to another port gets a refusal).
Afterwards the connection is plain TCP: it keeps out whoever can reach the port, not whoever sits on
the path (docs/security.md).
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import ipaddress
import os
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from sidecar import framing, tls
from sidecar.config import LinkSecurity
from sidecar.certs import Identity
from sidecar.consensus import codec, limits
from sidecar.consensus.messages import AuthChallenge, AuthConfirm, AuthResponse

# v2 (the certificates, the port and the roles signed too): a v1 peer's signature never verifies.
CLIENT_CONTEXT = b"walsidecar-link-auth-v2 client"
SERVER_CONTEXT = b"walsidecar-link-auth-v2 server"
_SIGNATURE = ec.ECDSA(hashes.SHA256())
# The subject fields tls.identity_of reads, under the names ssl.getpeercert() gives them.
_PEERCERT_NAMES = {NameOID.ORGANIZATION_NAME: "organizationName",
                   NameOID.ORGANIZATIONAL_UNIT_NAME: "organizationalUnitName",
                   NameOID.COMMON_NAME: "commonName"}


class LinkAuthError(ConnectionError):
    """The peer did not prove a certificate from the deployment's CA; the connection is closed."""


class LinkAuth:
    """A process's certificates directory, for authenticating links without TLS."""

    def __init__(self, certs_dir: Path) -> None:
        paths = tls.node_files(certs_dir)
        try:
            self.cas = x509.load_pem_x509_certificates(paths[0].read_bytes())
            self.cert = x509.load_pem_x509_certificate(paths[1].read_bytes())
            key = serialization.load_pem_private_key(paths[2].read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as e:
            raise tls.TlsError(f"cannot use the certificates in {certs_dir}: {e}") from e
        if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != self.cert.public_key():
            raise tls.TlsError(f"{paths[2]} is not the EC key of {paths[1]}")
        self.key = key
        self.cert_der = self.cert.public_bytes(serialization.Encoding.DER)

    def challenge(self) -> tuple[bytes, bytes]:
        """The safekeeper's side, first: its nonce, and the encoded AuthChallenge to send."""
        server_nonce = os.urandom(limits.AUTH_NONCE)
        return server_nonce, codec.encode(AuthChallenge(server_nonce, self.cert_der))

    def confirm(self, server_nonce: bytes, msg: object, port: int | None) -> tuple[Identity | None, bytes]:
        """The safekeeper's side, then: verify the answer to `challenge()` that arrived on `port`; who
        the peer is, and the encoded AuthConfirm that proves this end.

        LinkAuthError if the peer fails: nothing has been answered then. Sans IO, so that whoever owns
        the connection (the safekeeper's connection thread) does the reading and the deadline.
        """
        if type(msg) is not AuthResponse:
            raise LinkAuthError(f"expected AuthResponse, got {type(msg).__name__}")
        cert = self._verify_certificate(msg.certificate)
        if not names_host(self.cert, msg.host):
            raise LinkAuthError(f"the peer dialled {msg.host!r}, a name this safekeeper's certificate does not have")
        if msg.port != port:
            # Another listener on this host passing on what it was sent (audit M-3), or a port
            # translated on the way, which auth-only cannot tell apart from one.
            raise LinkAuthError(f"the peer dialled port {msg.port}, not {port}, where it arrived: a relay, "
                                "or port translation (auth-only needs the safekeeper's own port)")
        signed = transcript(self.cert_der, msg.certificate, server_nonce, msg.nonce, msg.host, msg.port)
        _verify_signature(cert, msg.signature, CLIENT_CONTEXT + signed)
        return identity(cert), codec.encode(AuthConfirm(self.cert_der, self.key.sign(SERVER_CONTEXT + signed,
                                                                                     _SIGNATURE)))

    async def authenticate(self, reader: framing.FrameReader, writer: framing.Writer, host: str,
                           port: int) -> Identity | None:
        """The dialler's side: check the safekeeper's certificate names `host`, prove this end over it,
        then verify the safekeeper's proof."""
        host = tls.server_hostname(host)
        challenge = await _read(reader, "before its challenge")
        if type(challenge) is not AuthChallenge:
            raise LinkAuthError(f"it sent {type(challenge).__name__} instead of a challenge: does it run with "
                                "--link-security auth-only?")
        if not challenge.certificate:
            raise LinkAuthError("its challenge carries no certificate: an older walsidecar (link auth v1); "
                                "upgrade both ends")
        # Checked before anything is signed: a proof goes only to a safekeeper that may get it.
        cert = self._verify_certificate(challenge.certificate)
        if not names_host(cert, host):
            raise LinkAuthError(f"its certificate does not name {host}, the host dialled (address mismatch)")
        client_nonce = os.urandom(limits.AUTH_NONCE)
        signed = transcript(challenge.certificate, self.cert_der, challenge.nonce, client_nonce, host, port)
        proof = self.key.sign(CLIENT_CONTEXT + signed, _SIGNATURE)
        writer.write(codec.encode(AuthResponse(self.cert_der, client_nonce, host, proof, port)))
        reply = await _read(reader, "during authentication: does it trust this certificate (the same CA)?")
        if type(reply) is not AuthConfirm:
            raise LinkAuthError(f"it answered {type(reply).__name__} instead of proving its certificate")
        if reply.certificate != challenge.certificate:
            raise LinkAuthError("it proved another certificate than the one it presented")
        _verify_signature(cert, reply.signature, SERVER_CONTEXT + signed)
        return identity(cert)

    def _verify_certificate(self, der: bytes) -> x509.Certificate:
        """A certificate issued by a CA in ca.crt, within its validity period, not itself a CA."""
        try:
            cert = x509.load_der_x509_certificate(der)
            issuer = next((ca for ca in self.cas if ca.subject == cert.issuer and _issued_by(cert, ca)), None)
            if issuer is None:
                raise LinkAuthError("its certificate is not signed by a CA in ca.crt")
            now = datetime.datetime.now(datetime.timezone.utc)
            for c, what in ((cert, "its certificate"), (issuer, "the CA of its certificate")):
                if not c.not_valid_before_utc <= now <= c.not_valid_after_utc:
                    raise LinkAuthError(f"{what} is outside its validity period")
            try:
                is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
            except x509.ExtensionNotFound:
                is_ca = False
            if is_ca or not isinstance(cert.public_key(), ec.EllipticCurvePublicKey):
                raise LinkAuthError("its certificate is not a node certificate with an EC key")
        except (ValueError, TypeError) as e:
            raise LinkAuthError(f"its certificate cannot be used: {e}") from None
        return cert


async def _read(reader: framing.FrameReader, when: str) -> object:
    try:
        return await reader.read_message()
    except (asyncio.IncompleteReadError, ConnectionError):
        raise LinkAuthError(f"it closed the connection {when}") from None
    except codec.ProtocolError as e:
        raise LinkAuthError(f"it sent something that is not the walsidecar protocol ({e}): does it run with "
                            "--link-security auth-only?") from None


def transcript(server_cert: bytes, client_cert: bytes, server_nonce: bytes, client_nonce: bytes,
               host: str, port: int) -> bytes:
    """What both ends sign (after their context): each certificate's hash, each nonce, the address
    dialled and each certificate's role, every field length-prefixed so that none can run into the next."""
    roles = []
    for der in (client_cert, server_cert):
        try:
            ident = identity(x509.load_der_x509_certificate(der))
        except ValueError:
            ident = None
        roles.append(ident.role.encode() if ident is not None else b"")
    fields = (hashlib.sha256(server_cert).digest(), hashlib.sha256(client_cert).digest(), server_nonce,
              client_nonce, host.encode(), port.to_bytes(2, "big"), *roles)
    return b"".join(len(f).to_bytes(2, "big") + f for f in fields)


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _verify_signature(cert: x509.Certificate, signature: bytes, transcript: bytes) -> None:
    try:
        cert.public_key().verify(signature, transcript, _SIGNATURE)  # type: ignore[call-arg, union-attr]
    except (InvalidSignature, ValueError, TypeError):
        raise LinkAuthError("the signature does not match its certificate") from None


def names_host(cert: x509.Certificate, host: str) -> bool:
    """True if the certificate's subject alternative names include `host` (a DNS name or an IP address)."""
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (x509.ExtensionNotFound, ValueError):
        return False
    try:
        return ipaddress.ip_address(host) in sans.get_values_for_type(x509.IPAddress)
    except ValueError:
        return host.lower().rstrip(".") in {n.lower().rstrip(".") for n in sans.get_values_for_type(x509.DNSName)}


def identity(cert: x509.Certificate) -> Identity | None:
    """The role in a verified certificate, read by the same code as a TLS peer's."""
    subject = tuple(((_PEERCERT_NAMES[a.oid], a.value),) for a in cert.subject if a.oid in _PEERCERT_NAMES)
    return tls.identity_of({"subject": subject})


Security = ssl.SSLContext | LinkAuth | None


def server_security(certs_dir: Path | None, mode: LinkSecurity = "tls") -> Security:
    """What a safekeeper listens with: TLS, auth-only, or nothing under --insecure (no certificates)."""
    if certs_dir is None:
        return None
    return tls.server_context(certs_dir) if mode == "tls" else LinkAuth(certs_dir)


def client_security(certs_dir: Path | None, mode: LinkSecurity = "tls") -> Security:
    """What the proposer and the tools dial safekeepers with."""
    if certs_dir is None:
        return None
    return tls.client_context(certs_dir) if mode == "tls" else LinkAuth(certs_dir)


async def dial(host: str, port: int, security: Security,
               max_frame: int = codec.REPLY_MAX_FRAME) -> tuple[framing.FrameReader, framing.Writer, Identity | None]:
    """Connect to a safekeeper and authenticate it as `security` says; who its certificate says it is.

    The caller checks the role. ssl.SSLError or LinkAuthError (both OSError) when it cannot be trusted.
    """
    if isinstance(security, ssl.SSLContext):
        reader, writer = await framing.open_connection(
            host, port, max_frame, ssl=security, server_hostname=tls.server_hostname(host),
            ssl_handshake_timeout=tls.HANDSHAKE_TIMEOUT)
        return reader, writer, tls.peer_role(writer)
    reader, writer = await framing.open_connection(host, port, max_frame)
    if security is None:
        return reader, writer, None
    try:
        ident = await asyncio.wait_for(security.authenticate(reader, writer, host, port), tls.HANDSHAKE_TIMEOUT)
    except asyncio.TimeoutError:
        writer.close()
        raise LinkAuthError(f"no authentication within {tls.HANDSHAKE_TIMEOUT:g}s: does it run with "
                            "--link-security auth-only?") from None
    except BaseException:
        writer.close()
        raise
    return reader, writer, ident
