"""Sharding rules: attention ops (to be written)."""
