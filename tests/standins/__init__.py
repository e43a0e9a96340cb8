"""Stand-ins for what cannot run in the tests (each named as such, following the real thing)."""
