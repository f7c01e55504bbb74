"""--optimizer sgd: plain SGD with AdamW's decoupled weight decay and no momentum
(optim/sgd.py), on any mesh, checkpointed with the parameters alone."""

import numpy as np
import pytest

from numpitron.checkpoint import load_checkpoint, save_checkpoint
from numpitron.distributed.topology import Topology
from numpitron.nn.mask_runs import mask_runs
from numpitron.optim.sgd import SGD
from tests.harness import SMALLER, check_mesh, make_trainer, tiny_model, tiny_tokens, tiny_train, train_steps
from tests.tolerances import EQUIV_RTOL_FLOAT64, rel_diff


def test_one_step_is_the_formula_written_out():
    rng = np.random.default_rng(0)
    p, g = rng.standard_normal(50), rng.standard_normal(50)
    decay = np.zeros(50, bool)
    decay[5:20] = decay[30:41] = True
    expected = np.where(decay, p * (1 - 0.1 * 0.01), p) - 0.1 * g
    rule = SGD(weight_decay=0.01)
    rule.update(p, g, mask_runs(decay), lr=0.1)
    np.testing.assert_allclose(p, expected, rtol=1e-15)
    assert rule.step_count == 1 and rule.flat_state() == {} and rule.state_nbytes == 0


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("mesh", [dict(data=2, zero_stage=1), dict(tensor=2)], ids=["dp2-zero1", "tp2"])
def test_sgd_on_a_mesh_trains_like_one_process(mesh):
    check_mesh({**mesh, "n_layers": 2}, optimizer="sgd", lr=0.1, min_lr=0.01)


@pytest.mark.parallel(nprocs=2)
def test_an_sgd_checkpoint_holds_the_parameters_and_resumes_on_another_mesh(shared_dir):
    model, train = tiny_model(**SMALLER), tiny_train(optimizer="sgd", lr=0.1, min_lr=0.01, global_batch_size=4)
    expected = train_steps(make_trainer(model, train, Topology.serial()), 6, tiny_tokens())
    source = make_trainer(model, train, data=2, zero_stage=2)
    train_steps(source, 3, tiny_tokens())
    path = save_checkpoint(shared_dir / "sgd", source)
    resumed = make_trainer(model, train, tensor=2)
    load_checkpoint(path, resumed)
    assert resumed.optimizer.adam.step_count == 3
    assert rel_diff(train_steps(resumed, 3, tiny_tokens()), expected[3:]) <= EQUIV_RTOL_FLOAT64
    assert not list((path / "shards").glob("*.bin")) or "adam_m" not in (path / "manifest.json").read_text()
