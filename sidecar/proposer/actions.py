"""What the proposer service and the fence term say about the core's actions: log lines and the errors to the user."""

from __future__ import annotations

from typing import Any

from sidecar.consensus.proposer import GreetingsRefused, ProposerEvent, TermsExhausted
from sidecar.lsn import format_lsn


def log_fields(values: dict[str, Any]) -> dict[str, Any]:
    """Log fields with their LSNs written as PostgreSQL writes them."""
    return {k: format_lsn(v) if k.endswith("_lsn") and isinstance(v, int) else v for k, v in values.items()}


def log_event(log: Any, event: ProposerEvent) -> None:
    getattr(log, event.level)(event.name, **log_fields(event.fields()))


def refused_text(a: GreetingsRefused, safekeepers: int, quorum: int, fix: str) -> str:
    """Why no quorum can form when too many safekeepers refuse the greeting, and `fix`."""
    reasons = "; ".join(f"safekeeper {peer}: {why}" for peer, why in sorted(a.reasons.items()))
    return (f"{len(a.reasons)} of {safekeepers} safekeepers refuse this primary, so no quorum of {quorum} can "
            f"form ({reasons}); {fix}")


def exhausted_text(a: TermsExhausted, max_term: int) -> str:
    held = f"safekeeper {a.peer} holds term {a.term}" if a.peer else f"term {a.term} was reached"
    return (f"no term is left to campaign in: {held}, the highest term the protocol allows ({max_term}). Something "
            "that is not this proposer gave it that term (a bug, or a client that can reach the safekeeper port); "
            "secure the safekeepers' ports, then reset that safekeeper's data directory and let it re-sync")
