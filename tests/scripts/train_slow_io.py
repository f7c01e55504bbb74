"""train_shakespeare.py whose checkpoint writes and deletions are slowed down, so that
kills at random moments land inside saves and prunes often."""

import runpy
import shutil
import sys
import time
from pathlib import Path

import numpitron.checkpoint.prune as prune
import numpitron.checkpoint.save as save

real_write, real_rmtree = save.write_rank_shard, shutil.rmtree


def slow_write(directory, trainer):
    # Inside the checkpoint's temporary directory, before and after the shard is written.
    time.sleep(0.03)
    table = real_write(directory, trainer)
    time.sleep(0.03)
    return table


def slow_rmtree(path, *args, **kwargs):
    time.sleep(0.02)
    real_rmtree(path, *args, **kwargs)


save.write_rank_shard = slow_write
prune.shutil.rmtree = slow_rmtree
sys.argv = ["train_shakespeare.py"] + sys.argv[1:]
runpy.run_path(str(Path(__file__).resolve().parents[2] / "train_shakespeare.py"), run_name="__main__")
