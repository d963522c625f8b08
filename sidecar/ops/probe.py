"""Ask running pieces what they are: a safekeeper over its protocol, the proposer over HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import urllib.request
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from sidecar import framing
from sidecar.consensus import codec
from sidecar.consensus.messages import InfoReply, InfoRequest, Refusal
from sidecar.proposer.peers import parse_address


class ProbeError(Exception):
    """The piece did not answer usefully; the message says how."""


async def probe_safekeeper(address: str, timeout: float) -> InfoReply:
    """Send an InfoRequest (read-only: it binds nothing and needs no Greeting)."""
    host, port = parse_address(address)
    try:
        reader, writer = await asyncio.wait_for(framing.open_connection(host, port), timeout)
    except asyncio.TimeoutError:
        raise ProbeError(f"no answer within {timeout:g}s") from None
    except OSError as e:
        # asyncio's message ("Connect call failed") hides the reason the errno gives.
        raise ProbeError(os.strerror(e.errno) if e.errno else str(e)) from None
    try:
        writer.write(codec.encode(InfoRequest()))
        msg = await asyncio.wait_for(reader.read_message(), timeout)
    except asyncio.TimeoutError:
        raise ProbeError(f"connected, but no reply within {timeout:g}s: is it a walsidecar safekeeper?") from None
    except (asyncio.IncompleteReadError, ConnectionError):
        raise ProbeError("it closed the connection without a reply: an older walsidecar, or not a safekeeper") from None
    except codec.ProtocolError as e:
        raise ProbeError(f"it answered something that is not the safekeeper protocol ({e})") from None
    finally:
        writer.close()
    if isinstance(msg, Refusal):
        raise ProbeError(f"it refused: {msg.reason}")
    if not isinstance(msg, InfoReply):
        raise ProbeError(f"it answered {type(msg).__name__} instead of InfoReply")
    return msg


def _get_json(url: str, timeout: float) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
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


async def fetch_status(address: str, timeout: float) -> dict[str, Any]:
    """The /status document of a proposer or safekeeper metrics endpoint."""
    return await asyncio.to_thread(_get_json, f"http://{address}/status", timeout)


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
    return await asyncio.wait_for(psycopg.AsyncConnection.connect(
        dsn, autocommit=True, connect_timeout=max(int(timeout), 1), application_name=f"walsidecar {purpose}"),
        timeout + 1)
