"""Graph passes: capture, sharding rules, simplification and code generation."""
