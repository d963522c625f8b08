"""Operator commands: `check`, `status` and `init-postgres`."""
