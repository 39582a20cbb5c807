"""Sharding rules: softmax ops (to be written)."""
