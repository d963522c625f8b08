"""Ask running pieces what they are: a safekeeper over its protocol, the proposer over HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import urllib.error
import urllib.request
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from sidecar.consensus import codec
from sidecar.consensus.messages import InfoReply, InfoRequest, Refusal
from sidecar.linkauth import LinkAuthError, Security, dial
from sidecar.address import parse_address


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


def _get_json(url: str, timeout: float, ssl_context: ssl.SSLContext | None = None) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=ssl_context) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        if e.code == 503:  # /quorum answers 503 with a body
            return json.loads(e.read())
        raise ProbeError(f"HTTP {e.code} from {url}") from None
    except urllib.error.URLError as e:
        reason = e.reason.strerror if isinstance(e.reason, OSError) and e.reason.strerror else e.reason
        raise ProbeError(f"{url}: {reason}") from None
    except (OSError, ValueError) as e:
        raise ProbeError(f"{url}: {e}") from None


async def fetch_status(address: str, timeout: float, ssl_context: ssl.SSLContext | None = None) -> dict[str, Any]:
    """The /status document of a proposer or safekeeper metrics endpoint (HTTPS off loopback, given a context)."""
    from sidecar.http import endpoint_url
    url = endpoint_url(address, ssl_context) + "/status"
    return await asyncio.to_thread(_get_json, url, timeout, ssl_context if url.startswith("https") else None)


def redact_dsn(dsn: str) -> str:
    """The connection string without its password, for output."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "(unparsable connection string)"
    params.pop("password", None)
    return make_conninfo(**params) if params else "(libpq defaults)"


async def connect(dsn: str, timeout: float, purpose: str) -> psycopg.AsyncConnection:
    """An autocommit connection with a connect timeout (libpq's own, in whole seconds)."""
    # `check` and `status` run a few queries once and exit: one plain connection each time. A pool
    # (as the proposer uses) would only add background connecting and health checks that outlive
    # the work, and a failure here is reported, not retried.
    return await asyncio.wait_for(psycopg.AsyncConnection.connect(
        dsn, autocommit=True, connect_timeout=max(int(timeout), 1), application_name=f"walsidecar {purpose}"),
        timeout + 1)
