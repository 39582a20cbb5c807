"""Sharding rules: pointwise ops (to be written)."""
