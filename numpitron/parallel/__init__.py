"""Data parallelism (gradient buckets), ZeRO stages 1 to 3, and pipeline schedules and their executor."""
