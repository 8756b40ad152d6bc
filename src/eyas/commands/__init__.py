"""Thin CLI shells over the library API, one verb per file."""
