"""Pipeline parallelism: schedules as data (GPipe, 1F1B, interleaved, zero-bubble, ZB-V,
DualPipeV), the one executor that runs them, the placement of virtual stages on ranks, and the
timeline that simulates a schedule. Chapters 5 and 11 of the book open this folder."""
