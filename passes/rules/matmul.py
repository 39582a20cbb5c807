"""Sharding rules: matmul ops (to be written)."""
