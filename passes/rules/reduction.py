"""Sharding rules: reduction ops (to be written)."""
