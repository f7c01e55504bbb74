"""Compressed gradients with error feedback for plain data parallelism: int8 and
PowerSGD (Vogels et al. 2019). A `CompressedDataParallelOptimizer` (optimizer.py) is
ZeRO-0's optimizer whose reduction sends a compressed gradient and keeps what the
compression dropped for the next step. Chapter 18 of the book, "Compressed gradients"."""
