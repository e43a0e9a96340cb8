"""Refit pipeline: sender mirror, routing, payloads, engine server, coordinator (docs/refit.md)."""
