"""Tests on walsidecar's container images (marker `containers`); see harness.py."""
