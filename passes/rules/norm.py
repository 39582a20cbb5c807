"""Sharding rules: norm ops (to be written)."""
