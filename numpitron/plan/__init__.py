"""Planning a run: what every rank stores and moves, from the configs and the mesh alone.

Infrastructure, not the teaching core: it reads the layers (their Params, their
kernels' counts, the schedules) to check a run before it starts, and nothing in the
core imports it (docs/architecture.md, "The house").
"""
