"""What the ranks' fork server imports before it forks any rank (``launch.PRELOAD``): autopar's
runtime and testing helpers, so that no rank imports them again (about 1 s a rank), then
``gc.freeze()``, which moves every object imported so far into the collector's permanent
generation: a rank's collections then neither walk them nor write to (and so copy) the pages it
shares with the server."""

import gc

import autopar.testing  # noqa: F401  (imported for the ranks)

gc.freeze()
