"""train_shakespeare.py whose every step takes SLOW_STEP_S seconds longer, so that a
test can take a host down between two checkpoints of a tiny run."""

import os
import runpy
import sys
import time
from pathlib import Path

from numpitron.trainer import Trainer

DELAY_S = float(os.environ["SLOW_STEP_S"])
real_step = Trainer.train_step


def slow_step(self, train_tokens):
    time.sleep(DELAY_S)
    return real_step(self, train_tokens)


Trainer.train_step = slow_step
sys.argv = ["train_shakespeare.py"] + sys.argv[1:]
runpy.run_path(str(Path(__file__).resolve().parents[2] / "train_shakespeare.py"), run_name="__main__")
