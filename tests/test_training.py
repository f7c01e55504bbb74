"""A short training run on a small text learns it."""

import numpy as np

from numpitron.data.tokenizer import CharTokenizer
from numpitron.distributed.topology import Topology
from tests.harness import make_trainer
from tests.harness import tiny_model, tiny_train


def test_short_run_lowers_the_loss():
    text = "to be or not to be, that is the question. " * 40
    tok = CharTokenizer.from_text(text)
    tokens = tok.encode(text)
    cfg = tiny_model("float32", vocab_size=tok.vocab_size)
    trainer = make_trainer(cfg, tiny_train(lr=3e-3, max_iters=60), Topology.serial())
    losses = [trainer.train_step(tokens)["train_loss"] for _ in range(60)]
    assert np.log(tok.vocab_size) - 0.2 < losses[0] < np.log(tok.vocab_size) + 0.2   # starts near uniform
    assert np.mean(losses[-5:]) < 0.5 * losses[0], losses[-5:]
    eval_losses = trainer.evaluate({"train": tokens}, eval_iters=2)
    assert eval_losses["train"] < 0.5 * losses[0]
