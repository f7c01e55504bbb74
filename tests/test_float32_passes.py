"""A float32 model computes in float32: no pass over its arrays is widened to float64.

NumPy 2 (NEP 50) treats a Python float as weak, so `x *= 0.5` on a float32 array
stays float32, but a NumPy float64 scalar is strong: `x *= np.sqrt(2 / np.pi)`
computes in float64 and casts back, seven times slower here, and silently, since an
in-place result keeps its dtype. The kernels below get arrays that check every
ufunc call they take part in (`Checked`); the layers' and modules' constants are
checked for NumPy float scalars.
"""

import importlib
import pkgutil

import numpy as np

import numpitron
from numpitron.config import ModelConfig
from numpitron.distributed.topology import Topology
from numpitron.build import build_stage
from numpitron.nn.functional import bias_gelu_forward, gelu_backward_, softmax_lastdim_with_lse_
from numpitron.nn.layernorm import LayerNorm
from numpitron.nn.param_store import ParamStore
from numpitron.optim.adamw import AdamW


class Checked(np.ndarray):
    """An array that records each ufunc call it takes part in, and the ones that
    compute in float64 although a float32 array takes part."""
    calls, widened = [], []

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        plain = [x.view(np.ndarray) if isinstance(x, Checked) else x for x in inputs]
        if out is not None:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, Checked) else o for o in out)
        arrays = [x for x in plain if isinstance(x, np.ndarray)]
        Checked.calls.append(ufunc.__name__)
        if any(a.dtype == np.float32 for a in arrays) and np.result_type(*plain) == np.float64:
            Checked.widened.append(f"{ufunc.__name__}.{method}")
        result = getattr(ufunc, method)(*plain, **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return result.view(Checked) if isinstance(result, np.ndarray) else result


def checked(a):
    return np.asarray(a, np.float32).view(Checked)


def run_checked(fn):
    Checked.calls.clear()
    Checked.widened.clear()
    fn()
    return list(Checked.calls), list(Checked.widened)


def test_the_check_sees_a_widened_pass():
    x = checked(np.ones(4))
    calls, widened = run_checked(lambda: x.__imul__(np.sqrt(2.0)))
    assert calls == ["multiply"] and widened == ["multiply.__call__"]
    assert run_checked(lambda: x.__imul__(float(np.sqrt(2.0))))[1] == []


def test_element_wise_kernels_stay_float32():
    rng = np.random.default_rng(0)
    h, bias = checked(rng.normal(size=(3, 5, 16))), checked(rng.normal(size=16))

    def gelu():
        y, slope = bias_gelu_forward(h.copy(), bias)
        gelu_backward_(checked(rng.normal(size=h.shape)), slope)

    def softmax():
        softmax_lastdim_with_lse_(checked(rng.normal(size=(2, 3, 4, 6))))

    def layernorm():
        layer = LayerNorm("ln", 16)
        ParamStore(layer.parameters(), np.float32).initialize(0)
        y, cache = layer.forward(checked(rng.normal(size=(3, 5, 16))))
        layer.backward_input(checked(rng.normal(size=y.shape)), cache)

    def adamw():
        opt = AdamW(40, np.float32)
        opt.m, opt.v, opt._scratch = opt.m.view(Checked), opt.v.view(Checked), opt._scratch.view(Checked)
        p, g = checked(rng.normal(size=40)), checked(rng.normal(size=40))
        for lr in (1e-3, 2e-3):
            opt.update(p, g, [(0, 40)], lr)

    for name, kernel in [("gelu", gelu), ("softmax", softmax), ("layernorm", layernorm), ("adamw", adamw)]:
        calls, widened = run_checked(kernel)
        assert len(calls) >= 8, f"{name}: only {calls} were checked"
        assert widened == [], f"{name} computes in float64: {widened}"


def numpy_float_scalars(obj, path, seen):
    """(path, value) of every NumPy float scalar reachable through obj's attributes."""
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, np.floating):
        return [(path, obj)]
    if isinstance(obj, (list, tuple)):
        return [hit for i, x in enumerate(obj) for hit in numpy_float_scalars(x, f"{path}[{i}]", seen)]
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("numpitron"):
        return [hit for k, v in vars(obj).items() for hit in numpy_float_scalars(v, f"{path}.{k}", seen)]
    return []


def test_no_numpy_float_constants_in_layers_or_modules():
    cfg = ModelConfig(vocab_size=11, seq_len=8, n_layers=2, n_heads=2, d_model=8, dtype="float32").validate()
    model = build_stage(cfg, Topology.serial(), seed=0)
    assert model.blocks[0].attn.scale > 0          # the walk below must reach the layers' constants
    assert numpy_float_scalars(model, "model", set()) == []
    for info in pkgutil.walk_packages(numpitron.__path__, "numpitron."):
        module = importlib.import_module(info.name)
        bad = [name for name, v in vars(module).items() if isinstance(v, np.floating)]
        assert bad == [], f"{info.name}: NumPy float scalars {bad} would widen float32 passes"
