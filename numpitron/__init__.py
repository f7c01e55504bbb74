"""numpitron: parallel GPT training with NumPy and MPI, every backward by hand."""

__version__ = "0.1.0"
