"""Sharding rules: factory ops (to be written)."""
