"""Sharding rules: loss ops (to be written)."""
