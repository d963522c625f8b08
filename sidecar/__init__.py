"""walsidecar: quorum-durable commit for a stock PostgreSQL."""

__version__ = "0.1.0"
