"""numpitron: 3D-parallel GPT training with NumPy and MPI."""

__version__ = "0.1.0"
