"""Process set-up done before NumPy and MPI start (numpitron/runtime.py)."""

import json
import os
import subprocess
import sys

import pytest

from numpitron import runtime
from tests.conftest import REPO


@pytest.fixture
def clean_env(monkeypatch):
    for var in (*runtime.BLAS_VARS, runtime.YIELD_VAR, "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_one_blas_thread_by_default_and_the_flag_wins(clean_env):
    runtime.configure_process([], tune_malloc=False)
    assert all(os.environ[v] == "1" for v in runtime.BLAS_VARS)
    runtime.configure_process(["--blas-threads", "2"], tune_malloc=False)
    assert all(os.environ[v] == "2" for v in runtime.BLAS_VARS)
    runtime.configure_process(["--blas-threads=3"], tune_malloc=False)
    assert os.environ["OPENBLAS_NUM_THREADS"] == "3"


def test_a_users_blas_setting_is_kept_without_the_flag(clean_env):
    clean_env.setenv("OPENBLAS_NUM_THREADS", "4")
    runtime.configure_process([], tune_malloc=False)
    assert os.environ["OPENBLAS_NUM_THREADS"] == "4"


def test_heavy_yield_only_when_ranks_outnumber_cores(clean_env):
    cores = runtime.usable_cores()
    clean_env.setenv("MPI_LOCALNRANKS", str(cores))
    runtime.configure_process([], tune_malloc=False)
    assert runtime.YIELD_VAR not in os.environ
    clean_env.setenv("MPI_LOCALNRANKS", str(cores + 1))
    runtime.configure_process([], tune_malloc=False)
    assert os.environ[runtime.YIELD_VAR] == "1"
    clean_env.setenv(runtime.YIELD_VAR, "0")            # the user's choice stands
    runtime.configure_process([], tune_malloc=False)
    assert os.environ[runtime.YIELD_VAR] == "0"


def test_a_benchmark_launch_drops_an_inherited_yield_only_when_the_ranks_fit(clean_env):
    cores = runtime.usable_cores()
    clean_env.setenv(runtime.YIELD_VAR, "1")
    assert runtime.YIELD_VAR not in runtime.launch_env(cores)
    assert runtime.launch_env(cores + 1)[runtime.YIELD_VAR] == "1"
    assert os.environ[runtime.YIELD_VAR] == "1"          # this process's own setting is untouched


FAULTS_PER_STEP = """
import json, resource, sys
from numpitron.runtime import configure_process
configure_process([], tune_malloc=sys.argv[1] == "tuned")
import numpy as np
from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
from numpitron.distributed.topology import Topology
from numpitron.build import build_trainer
cfg = ModelConfig(n_layers=2)
trainer = build_trainer(cfg, ParallelConfig(), TrainConfig(max_iters=10), Topology.serial())
tokens = np.random.default_rng(0).integers(0, 65, 20000).astype(np.uint16)
trainer.train_step(tokens)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    trainer.train_step(tokens)
print(json.dumps((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 3))
"""


def test_malloc_tuning_stops_every_step_faulting_its_activations_in_again():
    def faults(mode):
        out = subprocess.run([sys.executable, "-c", FAULTS_PER_STEP, mode], capture_output=True, text=True,
                             cwd=REPO, check=True, timeout=120)
        return json.loads(out.stdout)
    tuned, default = faults("tuned"), faults("default")
    # glibc's defaults unmap each freed activation (~10,000 faults a step here); tuned, nearly none
    assert tuned * 10 < default, (tuned, default)
