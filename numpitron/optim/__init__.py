"""AdamW, the learning-rate schedule and global-norm gradient clipping."""
