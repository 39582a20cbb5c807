"""Sharding rules: indexing ops (to be written)."""
