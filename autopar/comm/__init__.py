"""The communication library emitted programs call: differentiable collectives over one mesh
axis, gradient bucketing, re-gathering of sharded parameters in backward, and the process groups
of a mesh (held by name)."""
