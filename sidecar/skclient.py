"""A client of a safekeeper's protocol port that is no proposer: asks it what it is (an InfoRequest).

Below both services: a safekeeper asks its peers (safekeeper/amnesia.py), the operator's commands ask every
safekeeper (check, status), and neither should import the other's package for it.
"""

from __future__ import annotations

import asyncio
import os
import ssl

from sidecar.address import parse_address
from sidecar.consensus import codec
from sidecar.consensus.messages import InfoReply, InfoRequest, Refusal
from sidecar.linkauth import LinkAuthError, Security, dial


class ProbeError(Exception):
    """The piece did not answer usefully; the message says how."""


async def probe_safekeeper(address: str, timeout: float, ssl_context: Security = None) -> InfoReply:
    """Send an InfoRequest (read-only: it binds nothing and needs no Greeting), over TLS or auth-only if given."""
    host, port = parse_address(address)
    try:
        reader, writer, ident = await asyncio.wait_for(dial(host, port, ssl_context), timeout)
    except LinkAuthError as e:
        raise ProbeError(f"authentication failed: {e}") from None
    except asyncio.TimeoutError:
        raise ProbeError(f"no answer within {timeout:g}s") from None
    except ssl.SSLCertVerificationError as e:
        raise ProbeError(f"its certificate was refused: {e.verify_message}") from None
    except ssl.SSLError as e:
        raise ProbeError(f"TLS handshake failed ({e.reason or e}): does it run with --certs-dir from this CA?") from None
    except OSError as e:
        # asyncio's message ("Connect call failed") hides the reason the errno gives.
        raise ProbeError(os.strerror(e.errno) if e.errno else str(e)) from None
    if ssl_context is not None and getattr(ident, "role", None) != "safekeeper":
        writer.close()
        raise ProbeError(f"its certificate ({ident or 'no role'}) is not a safekeeper's")
    try:
        writer.write(codec.encode(InfoRequest()))
        msg = await asyncio.wait_for(reader.read_message(), timeout)
    except asyncio.TimeoutError:
        raise ProbeError(f"connected, but no reply within {timeout:g}s: is it a walsidecar safekeeper?") from None
    except ssl.SSLError as e:
        raise ProbeError(f"it refused this TLS client ({e.reason or e}): is --certs-dir from its CA?") from None
    except (asyncio.IncompleteReadError, ConnectionError):
        raise ProbeError("it closed the connection without a reply: an older walsidecar, not a safekeeper, "
                         "or one that wants TLS (give --certs-dir)") from None
    except codec.ProtocolError as e:
        raise ProbeError(f"it answered something that is not the safekeeper protocol ({e})") from None
    finally:
        writer.close()
    if isinstance(msg, Refusal):
        raise ProbeError(f"it refused: {msg.reason}")
    if not isinstance(msg, InfoReply):
        raise ProbeError(f"it answered {type(msg).__name__} instead of InfoReply")
    return msg
