"""Sharding rules: conv ops (to be written)."""
