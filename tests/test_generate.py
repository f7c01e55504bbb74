"""Generation: the KV cache gives the logits of a full forward, the same seed gives
the same text, and sampling on any tp x pp x dp mesh gives the text of one process."""

import os
import select
import subprocess
import sys
import time

import numpy as np
import pytest
from mpi4py import MPI

from numpitron.checkpoint import save_checkpoint
from numpitron.data.tokenizer import CharTokenizer
from numpitron.distributed.topology import Topology
from numpitron.generate import generate, new_kv_cache, next_token_logits, stream
from numpitron.build import build_stage
from tests.conftest import REPO
from tests.harness import make_trainer, tiny_model, tiny_tokens, tiny_train
from tests.tolerances import EQUIV_RTOL_FLOAT64, rel_diff


def test_kv_cache_matches_full_forward():
    """The model's own forward, given a cache, one position at a time (and a prompt
    of 5 at once) gives the logits of one full forward."""
    cfg = tiny_model()
    model = build_stage(cfg, Topology.serial(), seed=3)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, cfg.seq_len))
    expected = model.forward(ids)[0][:, :, :cfg.vocab_size]
    kv = new_kv_cache(model, 2)
    prompt = 5
    got = [next_token_logits(model, ids[:, :prompt], kv)]
    for pos in range(prompt, cfg.seq_len):
        got.append(next_token_logits(model, ids[:, pos:pos + 1], kv))
    assert kv.pos == cfg.seq_len
    assert rel_diff(np.stack(got, axis=1), expected[:, prompt - 1:]) <= EQUIV_RTOL_FLOAT64


def test_same_seed_same_tokens_and_window_slides_past_seq_len():
    cfg = tiny_model()
    model = build_stage(cfg, Topology.serial(), seed=3)
    a = generate(model, [1, 2, 3], 3 * cfg.seq_len, num_samples=2, temperature=1.0, top_k=10, seed=5)
    b = generate(model, [1, 2, 3], 3 * cfg.seq_len, num_samples=2, temperature=1.0, top_k=10, seed=5)
    c = generate(model, [1, 2, 3], 3 * cfg.seq_len, num_samples=2, temperature=1.0, top_k=10, seed=6)
    assert a.shape == (2, 3 + 3 * cfg.seq_len)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert a.max() < cfg.vocab_size


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    cfg = tiny_model("float32")
    trainer = make_trainer(cfg, tiny_train(), Topology.serial())
    for _ in range(3):
        trainer.train_step(tiny_tokens())
    chars = [chr(c) for c in range(ord("0"), ord("0") + 65)]
    return save_checkpoint(root, trainer, extra={"tokenizer": CharTokenizer(chars).to_dict()})


def sample(checkpoint, tensor=1, pipeline=1, data=1, *extra):
    cmd = [sys.executable, str(REPO / "sample.py"), "--checkpoint", str(checkpoint), "--prompt", "123",
           "--max-new-tokens", "80", "--seed", "11", "--num-samples", "2", *extra]
    nprocs = tensor * pipeline * data
    if nprocs > 1:
        cmd = [str(REPO / ".venv/bin/mpiexec") if (REPO / ".venv/bin/mpiexec").exists() else "mpiexec",
               "-n", str(nprocs)] + cmd + ["--tensor-parallel-size", str(tensor), "--pipeline-parallel-size",
                                          str(pipeline), "--data-parallel-size", str(data)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_sampling_is_reproducible_and_every_mesh_matches_serial(checkpoint):
    serial = sample(checkpoint)
    assert serial == sample(checkpoint)
    first, second = serial.split("\n---------------\n")
    assert first.startswith("123") and len(first) == 83 and first != second.rstrip("\n")
    assert sample(checkpoint, tensor=2) == serial          # printed once, same text
    assert sample(checkpoint, pipeline=2) == serial
    assert sample(checkpoint, data=2) == serial
    assert sample(checkpoint, tensor=4) == serial
    assert sample(checkpoint, tensor=2, pipeline=2) == serial
    assert sample(checkpoint, pipeline=2, data=2) == serial


def generated_on(model_cfg, topo, num_samples=4, **options):
    model = build_stage(model_cfg, topo, seed=3)
    return generate(model, [1, 2, 3], 2 * model_cfg.seq_len, num_samples=num_samples, seed=5, **options)


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("mesh", [dict(pipeline=2), dict(data=2)], ids=["pp2", "dp2"])
def test_greedy_and_seeded_samples_on_a_mesh_are_those_of_one_process(mesh):
    """In float64, in one process each: the mesh's tokens equal the serial ones, greedy
    and seeded (past the window slide), on every rank; with dp, also when the samples do
    not divide over the replicas (3) or leave one with none (1)."""
    cfg = tiny_model()
    for options in (dict(temperature=0.0), dict(temperature=1.0, top_k=10), dict(temperature=1.0, num_samples=3),
                    dict(temperature=1.0, num_samples=1)):
        expected = generated_on(cfg, Topology.serial(), **options)
        got = generated_on(cfg, Topology.from_world(**mesh), **options)
        everyone = MPI.COMM_WORLD.allgather(got)
        assert all(np.array_equal(g, expected) for g in everyone), options
        if options.get("num_samples") == 1:      # streamed, token by token, on every rank
            model = build_stage(cfg, Topology.from_world(**mesh), seed=3)
            streamed = list(stream(model, [1, 2, 3], 2 * cfg.seq_len, seed=5, **options_without(options)))
            assert all(s == list(expected[0, 3:]) for s in MPI.COMM_WORLD.allgather(streamed))


def options_without(options, key="num_samples"):
    return {k: v for k, v in options.items() if k != key}


def test_one_sample_is_printed_as_it_is_drawn_and_as_before(checkpoint):
    """`sample.py --max-new-tokens 1000000000` printed nothing until it was done (and kept
    every token): one sample now streams, keeping the model's window only, and prints the
    text the batch of samples gives for it."""
    first = sample(checkpoint).split("\n---------------\n")[0]
    assert sample(checkpoint, 1, 1, 1, "--num-samples", "1") == first + "\n"
    assert sample(checkpoint, 1, 1, 2, "--num-samples", "1") == first + "\n"     # dp = 2: printed once
    cmd = [sys.executable, str(REPO / "sample.py"), "--checkpoint", str(checkpoint), "--prompt", "123",
           "--max-new-tokens", str(10**9)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        text, deadline = b"", time.monotonic() + 60
        while len(text) < 20 and time.monotonic() < deadline and select.select([proc.stdout], [], [], 1)[0]:
            text += os.read(proc.stdout.fileno(), 100) or b"!"          # "!": the end of the output
        assert text.startswith(b"123") and len(text) >= 20 and b"!" not in text and proc.poll() is None, (text, proc.poll())
        proc.stdout.close()                 # the reader leaves, as `| head` does: no traceback
        assert proc.wait(timeout=60) == 1 and proc.stderr.read() == b""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
