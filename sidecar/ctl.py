"""`walsidecar ctl`: stop, start and list the members of a running `walsidecar up`.

`up` listens on DIR/up.sock, a unix socket only its owner (and root) may open (mode 0600). A request
is one JSON line ({"action": "stop", "member": "safekeeper2"}), the answer one JSON line ({"ok": ...,
"message": ..., "members": [...]}). `up` answers between supervision rounds, in its main thread.
"""

from __future__ import annotations

import json
import os
import select
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sidecar.deployment import DeploymentError
from sidecar.supervisor import Supervisor

SOCKET_NAME = "up.sock"
ACTIONS = ("members", "stop", "start", "restart", "kill")
MAX_REQUEST = 4096


class CtlError(Exception):
    """No answer, or a refusal; the message says why."""


def socket_path(base: Path) -> Path:
    return Path(base) / SOCKET_NAME


class ControlSocket:
    """`up`'s end: a listening unix socket at DIR/up.sock, served by poll() calls from the main loop."""

    def __init__(self, base: Path) -> None:
        self.path = socket_path(base)
        # The caller holds DIR's lock, so a socket file left here is from an `up` that died.
        self.path.unlink(missing_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # created 0600: nobody else may stop our members
        try:
            self.sock.bind(str(self.path))
        finally:
            os.umask(old)
        self.sock.listen(4)

    def poll(self, handle: Callable[[dict[str, Any]], dict[str, Any]], timeout: float) -> None:
        """Wait up to `timeout` seconds for a request and answer it with `handle(request)`."""
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return
        conn, _ = self.sock.accept()
        with conn:
            conn.settimeout(5)  # a client that connects and says nothing must not stall supervision
            try:
                request = json.loads(_read_line(conn))
                if not isinstance(request, dict):
                    raise ValueError("a request is a JSON object")
                answer = handle(request)
            except (OSError, ValueError) as e:
                answer = {"ok": False, "message": f"bad request: {e}"}
            try:
                conn.sendall(json.dumps(answer).encode() + b"\n")
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()
        self.path.unlink(missing_ok=True)


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(MAX_REQUEST)
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_REQUEST:
            raise ValueError("request too long")
    return data


def request(base: Path, action: str, member: str | None = None, timeout: float = 120) -> dict[str, Any]:
    """Ask the `up` running in `base`; CtlError when none answers or it refuses."""
    path = socket_path(base)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise CtlError(f"no `walsidecar up` running in {base} (nothing listens on {path}); start one with "
                           f"`walsidecar up --dir {base}`") from None
        except PermissionError:
            raise CtlError(f"permission denied on {path}: run ctl as the user running `walsidecar up`") from None
        try:
            s.sendall(json.dumps({"action": action, "member": member}).encode() + b"\n")
            answer = json.loads(_read_line(s) or b"null")
        except socket.timeout:
            raise CtlError(f"`walsidecar up` in {base} did not answer within {timeout:g}s") from None
        except (OSError, ValueError) as e:
            raise CtlError(f"`walsidecar up` in {base} gave no answer: {e}") from None
    if not isinstance(answer, dict):
        raise CtlError(f"`walsidecar up` in {base} closed the connection without an answer")
    if not answer.get("ok"):
        raise CtlError(answer.get("message") or "refused")
    return answer


def members_table(rows: list[dict[str, Any]]) -> str:
    """One line per member: name, pid, state, restarts."""
    head = ("MEMBER", "PID", "STATE", "RESTARTS")
    cells = [head] + [(r["name"], str(r["pid"] or "-"), r["state"], str(r["restarts"])) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def answer(supervisor: Supervisor, req: dict[str, Any]) -> dict[str, Any]:
    """`up`'s answer to one request."""
    action, member = req.get("action"), req.get("member")
    names = ", ".join(supervisor.watched)
    if action not in ACTIONS:
        return {"ok": False, "message": f"unknown action {action!r}: one of {', '.join(ACTIONS)}"}
    if action == "members":
        return {"ok": True, "members": supervisor.members()}
    if not member:
        return {"ok": False, "message": f"{action} needs a MEMBER: one of {names}"}
    try:
        message = getattr(supervisor, action)(member)
    except KeyError as e:
        return {"ok": False, "message": str(e.args[0])}
    except DeploymentError as e:
        return {"ok": False, "message": f"{action} {member} failed: {e}"}
    return {"ok": True, "message": message, "members": supervisor.members()}
