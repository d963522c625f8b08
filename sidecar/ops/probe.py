"""Ask running pieces what they are over HTTP (a safekeeper over its protocol: sidecar/skclient.py)."""

from __future__ import annotations

import asyncio
import json
import ssl
import urllib.error
import urllib.request
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from sidecar.skclient import ProbeError


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
