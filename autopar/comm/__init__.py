"""The communication library emitted programs call, a leaf above the core:

- :mod:`~autopar.comm.collectives` — the ``autopar_*`` functions emitted code calls, over the
  mesh :func:`~autopar.comm.collectives.use_mesh` installs;
- :mod:`~autopar.comm.differentiable` — those collectives as autograd functions with a chosen backward;
- :mod:`~autopar.comm.plain` — the same without autograd;
- :mod:`~autopar.comm.buckets` — gradient bucketing, deferred gradient sums, outputs in flight;
- :mod:`~autopar.comm.regather` — sharded parameters gathered again in backward;
- :mod:`~autopar.comm.mesh`, :mod:`~autopar.comm.groups` — this rank's mesh and its process
  groups (held by name).
"""
