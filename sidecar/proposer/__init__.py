"""The proposer service attached to a PostgreSQL primary."""
