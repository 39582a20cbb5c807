"""Sharding rules: pooling ops (to be written)."""
