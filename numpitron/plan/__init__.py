"""Planning a run: what every rank stores and moves, from the configs and the mesh alone."""
