"""Data parallelism (gradient all-reduce), ZeRO-1, and pipeline schedules."""
