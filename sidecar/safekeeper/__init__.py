"""The safekeeper (acceptor) service."""
