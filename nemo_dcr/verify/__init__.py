"""Verification: layout-independent checksums (checksum.py) and trainer/engine comparison (report.py)."""
