"""train_shakespeare.py whose checkpoint writes are slowed down and announced, so
that a test can kill the process in the middle of a save."""

import os
import runpy
import sys
import time
from pathlib import Path

import numpitron.checkpoint.save as save

MARKER = Path(os.environ["SLOW_SAVE_MARKER"])
real_write = save.write_rank_shard


def slow_write(directory, trainer):
    MARKER.touch()        # "a save is under way": the test may kill us now
    time.sleep(0.2)
    return real_write(directory, trainer)


save.write_rank_shard = slow_write
sys.argv = ["train_shakespeare.py"] + sys.argv[1:]
runpy.run_path(str(Path(__file__).resolve().parents[2] / "train_shakespeare.py"), run_name="__main__")
