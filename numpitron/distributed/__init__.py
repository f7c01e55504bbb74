"""Process mesh, collectives, sharding bounds and the zigzag split of a sequence over cp."""
