"""Data parallelism: gradient buckets all-reduced during the backward, ZeRO-1, 2 and 3
(Rajbhandari et al. 2020), hybrid sharding, and the optimizer interface they share. Chapters 3,
8 and 9 of the book open this folder."""
