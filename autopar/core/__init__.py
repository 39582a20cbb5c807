"""The core every layer builds on: errors, placements, the shared IR (tensor metadata, op specs,
strategies, sharding assignments), options, rank layout on a mesh and the one resharding planner.
Nothing here imports any other part of autopar."""
