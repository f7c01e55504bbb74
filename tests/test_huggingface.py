"""Hugging Face GPT-2 export and import, without PyTorch: the file's names, shapes and
dtypes are GPT-2's, GPT-2's forward written here from those tensors gives our logits,
export then import is bit for bit, and the tokenizer file round-trips the corpus."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from numpitron.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from numpitron.checkpoint.huggingface import export_hf, import_hf
from numpitron.config import TrainConfig
from numpitron.data.tokenizer import CharTokenizer
from numpitron.distributed.topology import Topology
from numpitron.errors import UserError
from tests.conftest import REPO, shakespeare_text_path
from tests.harness import SMALLER, make_trainer, snapshot, tiny_model, train_steps

MODEL = tiny_model(**SMALLER)                  # float64, vocab 65, T 16, 2 layers, 2 heads, C 32
TRAIN = TrainConfig(micro_batch_size=2, global_batch_size=4, max_iters=10, warmup_iters=2, seed=1).validate()
TOKENS = np.random.default_rng(0).integers(0, 65, 5000).astype(np.uint16)


@pytest.fixture(scope="module")
def corpus():
    return shakespeare_text_path().read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def saved(tmp_path_factory, corpus):
    """A checkpoint after 3 steps (with the corpus's tokenizer), its trainer, and its export."""
    trainer = make_trainer(MODEL, TRAIN, Topology.serial())
    train_steps(trainer, 3, TOKENS)
    root = tmp_path_factory.mktemp("hf")
    path = save_checkpoint(root / "checkpoints", trainer, extra={"tokenizer": CharTokenizer.from_text(corpus).to_dict()})
    return path, trainer, export_hf(path, root / "gpt2")


def gpt2_layout(C=32, V=65, T=16, L=2) -> dict:
    """GPT2LMHeadModel's state dict (less the tied lm_head), written out from its source."""
    shapes = {"transformer.wte.weight": (V, C), "transformer.wpe.weight": (T, C),
              "transformer.ln_f.weight": (C,), "transformer.ln_f.bias": (C,)}
    for i in range(L):
        h = f"transformer.h.{i}."
        shapes.update({h + "ln_1.weight": (C,), h + "ln_1.bias": (C,), h + "ln_2.weight": (C,), h + "ln_2.bias": (C,),
                       h + "attn.c_attn.weight": (C, 3 * C), h + "attn.c_attn.bias": (3 * C,),
                       h + "attn.c_proj.weight": (C, C), h + "attn.c_proj.bias": (C,),
                       h + "mlp.c_fc.weight": (C, 4 * C), h + "mlp.c_fc.bias": (4 * C,),
                       h + "mlp.c_proj.weight": (4 * C, C), h + "mlp.c_proj.bias": (C,)})
    return shapes


def gpt2_logits(w: dict, ids: np.ndarray, n_head: int) -> np.ndarray:
    """GPT-2's forward (transformers' modeling_gpt2, eval mode) in NumPy, from HF tensors."""
    def layer_norm(x, name):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-5) * w[name + ".weight"] + w[name + ".bias"]

    def gelu_new(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    T = len(ids)
    x = w["transformer.wte.weight"][ids] + w["transformer.wpe.weight"][:T]
    C = x.shape[-1]
    i = 0
    while f"transformer.h.{i}.ln_1.weight" in w:
        h = f"transformer.h.{i}."
        qkv = layer_norm(x, h + "ln_1") @ w[h + "attn.c_attn.weight"] + w[h + "attn.c_attn.bias"]
        q, k, v = (part.reshape(T, n_head, -1).transpose(1, 0, 2) for part in np.split(qkv, 3, axis=-1))
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(C // n_head)
        scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        y = (p / p.sum(-1, keepdims=True) @ v).transpose(1, 0, 2).reshape(T, C)
        x = x + y @ w[h + "attn.c_proj.weight"] + w[h + "attn.c_proj.bias"]
        m = gelu_new(layer_norm(x, h + "ln_2") @ w[h + "mlp.c_fc.weight"] + w[h + "mlp.c_fc.bias"])
        x = x + m @ w[h + "mlp.c_proj.weight"] + w[h + "mlp.c_proj.bias"]
        i += 1
    return layer_norm(x, "transformer.ln_f") @ w["transformer.wte.weight"].T


def test_export_has_gpt2s_names_shapes_dtypes_and_config(saved):
    _, _, out = saved
    tensors = load_file(out / "model.safetensors")
    assert {n: a.shape for n, a in tensors.items()} == gpt2_layout()
    assert {a.dtype for a in tensors.values()} == {np.dtype("float64")}
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in ("model_type", "n_layer", "n_head", "n_embd", "n_positions", "vocab_size",
                                   "activation_function", "layer_norm_epsilon", "torch_dtype")} == {
        "model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 16, "vocab_size": 65,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "torch_dtype": "float64"}
    with open(out / "model.safetensors", "rb") as f:         # the header transformers reads first
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["__metadata__"] == {"format": "pt"}


def test_gpt2s_forward_on_the_export_gives_our_logits(saved):
    _, trainer, out = saved
    ids = TOKENS[:16].astype(np.int64)
    ours, _ = trainer.model.forward(ids[None])
    theirs = gpt2_logits(load_file(out / "model.safetensors"), ids, n_head=2)
    np.testing.assert_allclose(theirs, ours[0], rtol=0, atol=1e-10)


def test_export_then_import_is_bit_for_bit_and_training_continues(saved, tmp_path):
    path, trainer, out = saved
    imported = import_hf(out, tmp_path / "root")
    assert imported == latest_checkpoint(tmp_path / "root")
    fresh = make_trainer(MODEL, TRAIN, Topology.serial())
    manifest = load_checkpoint(imported, fresh)
    assert manifest["iteration"] == 0 and manifest["tokenizer"] == json.loads(
        (path / "manifest.json").read_text())["tokenizer"]
    assert np.array_equal(fresh.model.store.data, trainer.model.store.data)
    assert np.isfinite(train_steps(fresh, 1, TOKENS)).all()


def test_tokenizer_json_round_trips_every_character_of_the_corpus(saved, corpus):
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(saved[2] / "tokenizer.json"))
    ids = tokenizer.encode(corpus).ids
    assert np.array_equal(ids, CharTokenizer.from_text(corpus).encode(corpus))
    assert tokenizer.decode(ids) == corpus
    assert tokenizer.decode(tokenizer.encode(" \n\nROMEO: ").ids) == " \n\nROMEO: "


def test_import_reads_gpt2s_own_names_and_any_vocabulary_order(saved, tmp_path):
    """The original GPT-2 files have no "transformer." prefix and may carry the attention
    mask buffers and the tied head; a tokenizer may number its characters in any order."""
    path, trainer, out = saved
    hf = tmp_path / "edited"
    shutil.copytree(out, hf)
    tensors = {n.removeprefix("transformer."): a for n, a in load_file(out / "model.safetensors").items()}
    reverse = np.arange(65)[::-1]
    tensors["wte.weight"] = np.ascontiguousarray(tensors["wte.weight"][reverse])
    tensors["lm_head.weight"] = tensors["wte.weight"]
    tensors["h.0.attn.bias"] = np.tril(np.ones((16, 16)))
    (hf / "model.safetensors").unlink()
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    spec = json.loads((out / "tokenizer.json").read_text())
    spec["model"]["vocab"] = {c: 64 - i for c, i in spec["model"]["vocab"].items()}
    (hf / "tokenizer.json").write_text(json.dumps(spec))
    fresh = make_trainer(MODEL, TRAIN, Topology.serial())
    load_checkpoint(import_hf(hf, tmp_path / "root"), fresh)
    assert np.array_equal(fresh.model.store.data, trainer.model.store.data)


def edit_json(directory, name, edit):
    payload = json.loads((directory / name).read_text())
    edit(payload)
    (directory / name).write_text(json.dumps(payload))


@pytest.mark.parametrize("name, edit, fragment", [
    ("config.json", lambda c: c.update(activation_function="relu"), "activation_function='relu'"),
    ("config.json", lambda c: c.update(layer_norm_epsilon=1e-6), "layer_norm_epsilon=1e-06"),
    ("config.json", lambda c: c.update(n_head=3), "n_embd (32) must be divisible by n_head (3)"),
    ("config.json", lambda c: c.update(n_embd=None), "n_embd must be a positive integer, got null"),
    ("config.json", lambda c: c.update(n_embd={"a": 1}), 'n_embd must be a positive integer, got {"a": 1}'),
    ("config.json", lambda c: c.update(n_head=True), "n_head must be a positive integer, got true"),
    ("config.json", lambda c: c.update(n_positions="16"), 'n_positions must be a positive integer, got "16"'),
    ("config.json", lambda c: c.update(n_layer=10 ** 9), "n_layer is 1000000000 but it holds 2 blocks"),
    ("config.json", lambda c: c.update(model_type="llama"), "not a GPT-2 config"),
    ("config.json", lambda c: c.update(n_layer=3), "n_layer is 3 but it holds 2 blocks"),
    ("config.json", lambda c: c.update(vocab_size=64), "vocab_size 64 differs from the tokenizer's 65"),
    ("tokenizer.json", lambda t: t["model"]["vocab"].update({"ab": 65}), "every token must be one character"),
    ("tokenizer.json", lambda t: t["model"]["vocab"].update({"é": 70}), "token ids must be 0 .. 65"),
    ("tokenizer.json", lambda t: t["added_tokens"].append({"id": 65, "content": "<|endoftext|>"}), "added"),
])
def test_import_refuses_what_numpitron_cannot_represent(saved, tmp_path, name, edit, fragment):
    hf = tmp_path / "hf"
    shutil.copytree(saved[2], hf)
    edit_json(hf, name, edit)
    with pytest.raises(UserError) as caught:
        import_hf(hf, tmp_path / "root")
    assert fragment in str(caught.value) and "\n" not in str(caught.value), caught.value
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_import_refuses_weights_that_are_not_finite(saved, tmp_path, bad):
    hf = tmp_path / "hf"
    shutil.copytree(saved[2], hf)
    tensors = load_file(saved[2] / "model.safetensors")
    tensors["transformer.h.1.mlp.c_fc.weight"][3, 4] = bad
    save_file(tensors, hf / "model.safetensors")
    with pytest.raises(UserError, match="transformer.h.1.mlp.c_fc.weight holds NaN or infinite values"):
        import_hf(hf, tmp_path / "root")
    assert not (tmp_path / "root").exists()


def test_untied_head_and_existing_files_are_refused_and_left_alone(saved, tmp_path):
    path, _, out = saved
    hf = tmp_path / "hf"
    shutil.copytree(out, hf)
    tensors = load_file(out / "model.safetensors")
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"] + 1
    save_file(tensors, hf / "model.safetensors")
    with pytest.raises(UserError, match="lm_head.weight differs"):
        import_hf(hf, tmp_path / "root")
    import_hf(out, tmp_path / "root")
    with pytest.raises(UserError, match="already holds checkpoints"):
        import_hf(out, tmp_path / "root")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="not an empty directory"):
        export_hf(path, mine)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep me"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_export_into_a_checkpoint_or_where_a_run_saves_is_refused(saved, tmp_path):
    path = saved[0]
    root = tmp_path / "run/checkpoints"
    shutil.copytree(path.parent, root)
    before = snapshot(tmp_path)
    for out in (root / path.name / "hf", root / "iter_000030", root / "iter_000030/hf", root / "latest"):
        with pytest.raises(UserError, match="refusing to write"):
            export_hf(root / path.name, out)
    assert snapshot(tmp_path) == before and not (root / "iter_000030").exists()


def test_experts_are_refused_in_one_line(tmp_path):
    trainer = make_trainer(tiny_model(**SMALLER, num_experts=2, moe_top_k=1), TRAIN, Topology.serial())
    path = save_checkpoint(tmp_path / "checkpoints", trainer)
    with pytest.raises(UserError, match="mixture-of-experts blocks \\(2 experts\\); GPT-2 has none"):
        export_hf(path, tmp_path / "gpt2")
    assert not (tmp_path / "gpt2").exists()


def run(*args, nprocs=None):
    launcher = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(nprocs)] if nprocs else []
    return subprocess.run([*launcher, sys.executable, *map(str, args)], capture_output=True, text=True, cwd=REPO,
                          timeout=180)


def test_a_tensor_parallel_run_exports_imports_and_resumes_on_one_process(tmp_path):
    """The commands of chapter 16: train on tp = 2, hf-export, hf-import, resume on one process."""
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(shakespeare_text_path(), data / "tinyshakespeare.txt")
    tiny = ["--n-layers", "2", "--n-heads", "2", "--d-model", "32", "--seq-len", "16", "--micro-batch-size", "2",
            "--eval-iters", "1", "--eval-interval", "2", "--no-progress", "--data-dir", data]
    done = run("train_shakespeare.py", *tiny, "--max-iters", "2", "--tensor-parallel-size", "2",
               "--out-dir", tmp_path / "run", nprocs=2)
    assert done.returncode == 0, done.stderr[-2000:]
    convert = ["-m", "numpitron.checkpoint.convert"]
    exported = run(*convert, "hf-export", tmp_path / "run/checkpoints/iter_000002", tmp_path / "gpt2")
    assert exported.returncode == 0 and exported.stderr == "" and len(exported.stdout.splitlines()) == 1, exported
    imported = run(*convert, "hf-import", tmp_path / "gpt2", tmp_path / "again/checkpoints")
    assert imported.returncode == 0 and len(imported.stdout.splitlines()) == 1, imported
    resumed = run("train_shakespeare.py", *tiny, "--max-iters", "3", "--resume", "--out-dir", tmp_path / "again")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    again = run(*convert, "hf-import", tmp_path / "gpt2", tmp_path / "again/checkpoints")
    assert again.returncode == 1 and again.stdout == "" and again.stderr.startswith("error: ")
    assert len(again.stderr.splitlines()) == 1 and "already holds checkpoints" in again.stderr
