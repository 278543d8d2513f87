"""Recorded reference data for the tests (and the scripts that regenerate it)."""
