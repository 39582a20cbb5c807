"""Sharding rules: embedding ops (to be written)."""
