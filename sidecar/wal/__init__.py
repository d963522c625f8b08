"""PostgreSQL WAL format: page and record decoding."""
