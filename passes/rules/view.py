"""Sharding rules: view ops (to be written)."""
