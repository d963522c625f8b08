"""The reader port's password file: SCRAM-SHA-256 verifiers, one reader a line, never a plain password.

A line is `NAME:SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>` (pg_authid's rolpassword
format, base64 fields), '#' starts a comment. The file must be private to its owner (mode 0600 or
less), as libpq wants of a .pgpass file. `walsidecar readers add|remove|list` manages it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
import secrets
import stat
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from scramp import ScramMechanism

from sidecar.durable import write_durably

MECHANISM = "SCRAM-SHA-256"
MECHANISM_PLUS = "SCRAM-SHA-256-PLUS"  # with tls-server-end-point channel binding, over TLS only
ITERATIONS = 4096  # PostgreSQL's default scram_iterations
SALT_LENGTH = 32  # scramp's make_auth_info default, so the salts `readers add` writes
MOCK_SECRET_FILE = "reader_mock_secret"
_NAME = re.compile(r"[^\s:#]{1,63}")
_VERIFIER = re.compile(r"SCRAM-SHA-256\$(\d{1,9}):([A-Za-z0-9+/=]+)\$([A-Za-z0-9+/=]+):([A-Za-z0-9+/=]+)")


class AuthFileError(Exception):
    """An auth file that cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True)
class Verifier:
    """What the server needs to check a SCRAM-SHA-256 proof (scramp's auth_info)."""

    salt: bytes
    stored_key: bytes
    server_key: bytes
    iterations: int

    def auth_info(self) -> tuple[bytes, bytes, bytes, int]:
        return self.salt, self.stored_key, self.server_key, self.iterations


def make_verifier(password: str, iterations: int = ITERATIONS) -> str:
    """The verifier text of `password` with a fresh random salt."""
    salt, stored, server, i = ScramMechanism(MECHANISM).make_auth_info(password, iteration_count=iterations)
    b64 = base64.b64encode
    return f"{MECHANISM}${i}:{b64(salt).decode()}${b64(stored).decode()}:{b64(server).decode()}"


def parse_verifier(text: str) -> Verifier:
    m = _VERIFIER.fullmatch(text)
    if m is None:
        raise ValueError("not a SCRAM-SHA-256 verifier (SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>)")
    try:
        salt, stored, server = (base64.b64decode(g, validate=True) for g in m.groups()[1:])
    except binascii.Error:
        raise ValueError("a field of the verifier is not base64") from None
    if len(stored) != 32 or len(server) != 32 or not salt or int(m[1]) < 1:
        raise ValueError("the verifier's keys are not 32 bytes, or its salt or iteration count is empty")
    return Verifier(salt, stored, server, int(m[1]))


def mock_verifier(user: str, secret: bytes, salt_length: int = SALT_LENGTH, iterations: int = ITERATIONS) -> Verifier:
    """A verifier no password matches: an unknown user is refused as a wrong password is.

    As PostgreSQL's scram_mock_salt: its salt is keyed by a secret (so no one can compute it), the
    same for every probe of `user`, and of the real salts' length and iteration count, so that
    server-first does not tell which names exist.
    """
    salt = b""
    block = 0
    while len(salt) < salt_length:
        salt += hmac.new(secret, block.to_bytes(4, "big") + user.encode(), hashlib.sha256).digest()
        block += 1
    return Verifier(salt[:salt_length], secrets.token_bytes(32), secrets.token_bytes(32), iterations)


def mock_secret(path: Path) -> bytes:
    """The secret of the mock salts, made once and kept in `path` so that they survive restarts."""
    try:
        data = path.read_bytes()
        if len(data) == 32:
            return data
    except FileNotFoundError:
        pass
    data = secrets.token_bytes(32)
    write_durably(path, data)  # made 0600
    return data


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise AuthFileError(f"reader name {name!r} must be 1-63 characters without spaces, ':' or '#'")
    return name


def check_private(path: Path) -> os.stat_result:
    """The file's stat; AuthFileError if it is missing, not a file, or readable by group or others."""
    try:
        st = path.stat()
    except OSError as e:
        raise AuthFileError(f"cannot read the reader auth file {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise AuthFileError(f"the reader auth file {path} is not a regular file")
    if st.st_mode & 0o077:
        raise AuthFileError(f"the reader auth file {path} has group or world access; permissions should be "
                            f"u=rw (0600) or less: chmod 600 {path}")
    return st


def _read(path: Path) -> str:
    check_private(path)
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise AuthFileError(f"cannot read the reader auth file {path}: {e}") from None


def load(path: Path) -> dict[str, str]:
    """Reader name -> verifier text; AuthFileError naming the line that is wrong."""
    return parse(path, _read(path))


def parse(path: Path, text: str) -> dict[str, str]:
    """The entries of the auth file `path` whose content is `text`."""
    out: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, verifier = line.partition(":")
        try:
            if not sep:
                raise ValueError("expected NAME:SCRAM-SHA-256$...")
            check_name(name)
            parse_verifier(verifier)
        except (ValueError, AuthFileError) as e:
            raise AuthFileError(f"{path} line {lineno}: {e}") from None
        out[name] = verifier
    return out


def _save(path: Path, entries: dict[str, str]) -> None:
    body = "# walsidecar reader port: NAME:SCRAM-SHA-256 verifier (walsidecar readers add|remove|list)\n"
    body += "".join(f"{n}:{v}\n" for n, v in sorted(entries.items()))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_durably(path, body.encode())  # made 0600
    except OSError as e:
        raise AuthFileError(f"cannot write the reader auth file {path}: {e.strerror or e}") from None


def add(path: Path, name: str, password: str) -> bool:
    """Add reader `name` or replace its password; True if it was new."""
    check_name(name)
    if not password:
        raise AuthFileError("the password is empty")
    entries = load(path) if path.exists() else {}
    new = name not in entries
    entries[name] = make_verifier(password)
    _save(path, entries)
    return new


def remove(path: Path, name: str) -> None:
    """Remove reader `name`; AuthFileError if it is not there."""
    entries = load(path)
    if name not in entries:
        raise AuthFileError(f"no reader {name!r} in {path}")
    del entries[name]
    _save(path, entries)


class AuthFile:
    """The auth file as the server reads it: parsed again whenever its content changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._text: str | None = None
        self._verifiers: dict[str, Verifier] = {}
        self.reload()

    def reload(self) -> None:
        """Read the file (small: one line per reader); AuthFileError if it cannot be used now."""
        text = _read(self.path)
        if text != self._text:
            self._verifiers = {name: parse_verifier(v) for name, v in parse(self.path, text).items()}
            self._text = text

    def lookup(self, name: str) -> Verifier | None:
        return self._verifiers.get(name)

    def usual_shape(self) -> tuple[int, int]:
        """The salt length and iteration count most verifiers have: what an unknown user's mock gets."""
        if not self._verifiers:
            return SALT_LENGTH, ITERATIONS
        shapes = Counter((len(v.salt), v.iterations) for v in self._verifiers.values())
        return shapes.most_common(1)[0][0]
