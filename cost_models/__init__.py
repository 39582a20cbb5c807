"""Cost models: device specs, compute, memory and communication costs."""
