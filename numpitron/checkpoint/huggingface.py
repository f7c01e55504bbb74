"""Checkpoint <-> a Hugging Face GPT-2 directory (no MPI, no PyTorch needed).

    python -m numpitron.checkpoint.convert hf-export CKPT_DIR OUT_DIR
    python -m numpitron.checkpoint.convert hf-import HF_DIR ROOT

numpitron's GPT is GPT-2's math (Radford et al. 2019): learned positions, pre-LayerNorm
blocks with eps 1e-5 and biases, the tanh GELU ("gelu_new"), attention scaled by
1/sqrt(head_dim), a final LayerNorm and the head tied to the token embedding. So the
conversion only renames tensors and flattens two of them:

    ours (logical tensors)                         GPT-2 (Conv1D weights are in x out, as ours)
    embedding.token.weight   (V, C)                transformer.wte.weight
    embedding.position.weight (T, C)               transformer.wpe.weight
    blocks.i.ln1 / ln2 .{weight,bias}              transformer.h.i.ln_1 / ln_2
    blocks.i.attn.qkv.weight (C, 3, C)             transformer.h.i.attn.c_attn.weight (C, 3C)
    blocks.i.attn.qkv.bias   (3, C)                transformer.h.i.attn.c_attn.bias   (3C,)
    blocks.i.attn.proj, mlp.fc, mlp.proj           attn.c_proj, mlp.c_fc, mlp.c_proj
    ln_f                                           transformer.ln_f

The (C, 3, C) layout is q | k | v, each with the heads in order (head h is columns
h*hd .. (h+1)*hd), which is GPT-2's split of its 3C outputs: a reshape, no permutation.
Logical tensors carry no tensor-parallel vocabulary padding, so V is the tokenizer's.
"""

import json
import os
import shutil
from pathlib import Path

import numpy as np

from numpitron.checkpoint.fresh import few, write_fresh_checkpoint
from numpitron.checkpoint.load import open_reader
from numpitron.checkpoint.manifest import LATEST_NAME, MANIFEST_NAME, TMP_PREFIX, iter_dirs, iteration_of, read_manifest
from numpitron.config import DTYPES, ModelConfig, from_dict
from numpitron.data.hf_tokenizer import chars_from_tokenizer_json, tokenizer_json
from numpitron.data.tokenizer import CharTokenizer
from numpitron.errors import UserError

WEIGHTS, CONFIG, TOKENIZER = "model.safetensors", "config.json", "tokenizer.json"
LAYER_NORM_EPS = 1e-5                     # nn/layernorm.py
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")   # two names of the same tanh approximation
# (ours, GPT-2's) per block; the shapes are equal except for the fused q|k|v.
BLOCK_NAMES = [("ln1.weight", "ln_1.weight"), ("ln1.bias", "ln_1.bias"),
               ("attn.qkv.weight", "attn.c_attn.weight"), ("attn.qkv.bias", "attn.c_attn.bias"),
               ("attn.proj.weight", "attn.c_proj.weight"), ("attn.proj.bias", "attn.c_proj.bias"),
               ("ln2.weight", "ln_2.weight"), ("ln2.bias", "ln_2.bias"),
               ("mlp.fc.weight", "mlp.c_fc.weight"), ("mlp.fc.bias", "mlp.c_fc.bias"),
               ("mlp.proj.weight", "mlp.c_proj.weight"), ("mlp.proj.bias", "mlp.c_proj.bias")]
# config.json's sizes (besides vocab_size, the tokenizer's) and our ModelConfig's names for them.
GPT2_SIZES = {"n_positions": "seq_len", "n_layer": "n_layers", "n_head": "n_heads", "n_embd": "d_model"}
OUTER_NAMES = [("embedding.token.weight", "wte.weight"), ("embedding.position.weight", "wpe.weight"),
               ("ln_f.weight", "ln_f.weight"), ("ln_f.bias", "ln_f.bias")]


def name_pairs(n_layers: int) -> list[tuple[str, str]]:
    """(our name, GPT-2's name in GPT2LMHeadModel) for every saved tensor."""
    pairs = list(OUTER_NAMES) + [(f"blocks.{i}.{ours}", f"h.{i}.{theirs}")
                                 for i in range(n_layers) for ours, theirs in BLOCK_NAMES]
    return [(ours, "transformer." + theirs) for ours, theirs in pairs]


def gpt2_config(model_cfg: ModelConfig) -> dict:
    """config.json of GPT2LMHeadModel: our sizes, our math, no dropout (we train without)."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": model_cfg.vocab_size, "n_positions": model_cfg.seq_len,
            "n_embd": model_cfg.d_model, "n_layer": model_cfg.n_layers, "n_head": model_cfg.n_heads,
            "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": LAYER_NORM_EPS,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "tie_word_embeddings": True, "use_cache": True,
            # GPT-2's default special ids (50256) lie outside a character vocabulary.
            "bos_token_id": None, "eos_token_id": None,
            "torch_dtype": model_cfg.dtype}


def export_hf(checkpoint_dir, out_dir, data_dir="data") -> Path:
    """Write OUT_DIR (new or empty) with config.json, model.safetensors, tokenizer.json
    and tokenizer_config.json from any checkpoint written on any mesh."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    _refuse_existing_files(out_dir)
    manifest = read_manifest(checkpoint_dir)
    try:
        model_cfg = from_dict(ModelConfig, manifest["model_config"]).validate()
    except TypeError as error:
        raise UserError(f"corrupt checkpoint manifest in {checkpoint_dir}: model_config: {error}") from None
    if model_cfg.num_experts:
        raise UserError(f"{checkpoint_dir} has mixture-of-experts blocks ({model_cfg.num_experts} experts); "
                        f"GPT-2 has none, so it has no Hugging Face GPT-2 form")
    tokenizer = (CharTokenizer.from_dict(manifest["tokenizer"]) if "tokenizer" in manifest
                 else CharTokenizer.load(Path(data_dir) / "tokenizer.json"))   # e.g. imported from .npz
    if tokenizer.vocab_size != model_cfg.vocab_size:
        raise UserError(f"the tokenizer has {tokenizer.vocab_size} characters but the model's vocabulary is "
                        f"{model_cfg.vocab_size}")
    get = open_reader(checkpoint_dir, manifest).getter("params", np.dtype(model_cfg.dtype))
    tensors = {theirs: np.ascontiguousarray(get(ours)).reshape(_gpt2_shape(ours, model_cfg))
               for ours, theirs in name_pairs(model_cfg.n_layers)}
    files = {CONFIG: _json_bytes(gpt2_config(model_cfg)),
             # "pt": the format transformers' loader asks the file's metadata for
             WEIGHTS: _safetensors().save(tensors, metadata={"format": "pt"}),
             TOKENIZER: _json_bytes(tokenizer_json(tokenizer)),
             "tokenizer_config.json": _json_bytes({"tokenizer_class": "PreTrainedTokenizerFast",
                                                   "clean_up_tokenization_spaces": False,
                                                   "model_max_length": model_cfg.seq_len})}
    _write_new_directory(out_dir, files)
    return out_dir


def import_hf(hf_dir, root) -> Path:
    """A fresh checkpoint (iteration 0, zero Adam state, the tokenizer in its manifest)
    in ROOT, which must hold no checkpoint yet. Returns the checkpoint directory."""
    hf_dir, root = Path(hf_dir), Path(root)
    if iter_dirs(root) or (root / LATEST_NAME).exists() or (root / LATEST_NAME).is_symlink():
        raise UserError(f"{root} already holds checkpoints: import into a new or empty directory")
    chars = chars_from_tokenizer_json(_read_json(hf_dir / TOKENIZER), str(hf_dir / TOKENIZER))
    tensors = _read_safetensors(hf_dir / WEIGHTS)
    model_cfg = _model_config(_read_json(hf_dir / CONFIG), hf_dir / CONFIG, tensors, len(chars))
    _check_blocks(hf_dir / WEIGHTS, tensors, model_cfg.n_layers)    # before a table of n_layer blocks
    expected = {theirs: (ours, _gpt2_shape(ours, model_cfg)) for ours, theirs in name_pairs(model_cfg.n_layers)}
    _check_names(hf_dir / WEIGHTS, tensors, expected)
    params = {}
    for theirs, (ours, shape) in expected.items():
        array = tensors[theirs]
        if array.shape != shape:
            raise UserError(f"{hf_dir / WEIGHTS}: {theirs} has shape {list(array.shape)}, expected {list(shape)}")
        if not np.all(np.isfinite(array)):
            raise UserError(f"{hf_dir / WEIGHTS}: {theirs} holds NaN or infinite values; a model to train must not")
        params[ours] = array.astype(model_cfg.dtype).reshape(_our_shape(ours, model_cfg))
    # CharTokenizer numbers the characters in sorted order: put the embedding's rows in it.
    order = np.argsort(np.array(chars), kind="stable")
    params["embedding.token.weight"] = np.ascontiguousarray(params["embedding.token.weight"][order])
    return write_fresh_checkpoint(root, model_cfg, params, str(hf_dir), tokenizer=CharTokenizer(chars).to_dict())


def add_hf_commands(commands) -> None:
    """hf-export and hf-import, beside convert.py's export and import."""
    export = commands.add_parser("hf-export", help="checkpoint directory -> Hugging Face GPT-2 directory")
    export.add_argument("checkpoint_dir")
    export.add_argument("out_dir", help="a new (or empty) directory")
    export.add_argument("--data-dir", default="data",
                        help="its tokenizer.json, for a checkpoint that holds no tokenizer (imported from .npz)")
    imp = commands.add_parser("hf-import", help="Hugging Face GPT-2 directory -> new checkpoint in ROOT")
    imp.add_argument("hf_dir")
    imp.add_argument("root", help="a directory that holds no checkpoint yet")


def run_hf_command(args) -> str:
    """The one line the command prints."""
    if args.command == "hf-export":
        out = export_hf(args.checkpoint_dir, args.out_dir, args.data_dir)
        return f"exported {args.checkpoint_dir} as Hugging Face GPT-2 in {out}"
    return f"imported {args.hf_dir} as checkpoint {import_hf(args.hf_dir, args.root)}"


def _gpt2_shape(ours: str, model_cfg: ModelConfig) -> tuple:
    C = model_cfg.d_model
    if ours.endswith("attn.qkv.weight"):
        return (C, 3 * C)
    if ours.endswith("attn.qkv.bias"):
        return (3 * C,)
    return _our_shape(ours, model_cfg)


def _our_shape(ours: str, model_cfg: ModelConfig) -> tuple:
    C, V, T = model_cfg.d_model, model_cfg.vocab_size, model_cfg.seq_len
    suffix = ours.split(".", 2)[-1] if ours.startswith("blocks.") else ours
    return {"embedding.token.weight": (V, C), "embedding.position.weight": (T, C),
            "attn.qkv.weight": (C, 3, C), "attn.qkv.bias": (3, C), "attn.proj.weight": (C, C),
            "mlp.fc.weight": (C, 4 * C), "mlp.fc.bias": (4 * C,), "mlp.proj.weight": (4 * C, C)}.get(suffix, (C,))


def _model_config(config, origin: Path, tensors: dict, vocab: int) -> ModelConfig:
    """Our ModelConfig from a GPT2Config, refusing anything whose math differs from ours."""
    if not isinstance(config, dict) or config.get("model_type") != "gpt2":
        raise UserError(f"{origin}: not a GPT-2 config (model_type must be \"gpt2\")")
    for key in GPT2_SIZES:                          # before any arithmetic on them
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"{origin}: {key} must be a positive integer, got {json.dumps(value)[:40]}")
    if config["n_embd"] % config["n_head"]:
        raise UserError(f"{origin}: n_embd ({config['n_embd']}) must be divisible by n_head ({config['n_head']})")
    differing = {"activation_function": config.get("activation_function", "gelu_new") in GELU_TANH,
                 "layer_norm_epsilon": config.get("layer_norm_epsilon", LAYER_NORM_EPS) == LAYER_NORM_EPS,
                 "n_inner": config.get("n_inner") in (None, 4 * config.get("n_embd", 0)),
                 "tie_word_embeddings": config.get("tie_word_embeddings", True) is True,
                 "scale_attn_weights": config.get("scale_attn_weights", True) is True,
                 "scale_attn_by_inverse_layer_idx": not config.get("scale_attn_by_inverse_layer_idx", False),
                 "add_cross_attention": not config.get("add_cross_attention", False)}
    bad = [key for key, ok in differing.items() if not ok]
    if bad:
        settings = ", ".join(f"{key}={config.get(key)!r}" for key in bad)
        raise UserError(f"{origin}: numpitron's GPT cannot represent {settings}")
    dtypes = {a.dtype for a in tensors.values()}
    dtype = "float64" if np.dtype("float64") in dtypes else "float32"    # float16 weights widen to float32
    if not all(np.issubdtype(d, np.floating) for d in dtypes) or dtype not in DTYPES:
        raise UserError(f"{origin.parent / WEIGHTS}: expected floating-point tensors, found {sorted(map(str, dtypes))}")
    if config.get("vocab_size") != vocab:
        raise UserError(f"{origin}: vocab_size {config.get('vocab_size')!r} differs from the tokenizer's "
                        f"{vocab} characters")
    try:
        return ModelConfig(vocab_size=vocab, **{ours: config[key] for key, ours in GPT2_SIZES.items()},
                           dtype=dtype).validate(label={ours: key for key, ours in GPT2_SIZES.items()}.get)
    except UserError as error:
        raise UserError(f"{origin}: {error}") from None


def _check_blocks(origin: Path, tensors: dict, n_layers: int) -> None:
    """config.json's n_layer against the blocks the file holds, so that a wrong count
    costs one line, not a name table as long as the count."""
    held = len({name.split(".")[2] for name in tensors if name.startswith("transformer.h.")})
    if n_layers != held:
        raise UserError(f"{origin} is not GPT-2 of its config.json: n_layer is {n_layers} but it holds {held} blocks")


def _check_names(origin: Path, tensors: dict, expected: dict) -> None:
    """Every GPT-2 tensor present; allowed extras: the tied head (if it equals the
    embedding) and the attention masks older transformers versions saved."""
    head = tensors.pop("lm_head.weight", None)
    if head is not None and not np.array_equal(head, tensors.get("transformer.wte.weight")):
        raise UserError(f"{origin}: lm_head.weight differs from transformer.wte.weight; numpitron's head is tied")
    for name in [n for n in tensors if n.endswith((".attn.bias", ".attn.masked_bias"))]:
        tensors.pop(name)
    missing, extra = sorted(expected.keys() - tensors.keys()), sorted(tensors.keys() - expected.keys())
    if missing or extra:
        raise UserError(f"{origin} is not GPT-2 of its config.json: missing {few(missing)}, unexpected {few(extra)}")


def _read_safetensors(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"not found: {path}")
    load_file = _safetensors().load_file
    try:
        tensors = load_file(path)
    except Exception as error:          # safetensors raises its own error types; each is one line here
        raise UserError(f"{path} is not a readable safetensors file: {error}") from None
    # A "transformer." prefix is what GPT2LMHeadModel saves; the original GPT-2 files have none.
    return {name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name: array
            for name, array in tensors.items()}


def _safetensors():
    try:
        import safetensors.numpy
    except ModuleNotFoundError:
        raise UserError('Hugging Face conversion needs the safetensors package: pip install -e ".[hf]"') from None
    return safetensors.numpy


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"not found: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"cannot read {path}: {error}") from None


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=1, ensure_ascii=False) + "\n").encode("utf-8")


def _refuse_existing_files(out_dir: Path) -> None:
    # Inside a checkpoint (which pruning would then delete, or never delete), or at a
    # name a run saves to (iter_NNNNNN, latest): convert export refuses these too.
    for directory in [out_dir.resolve(), *out_dir.resolve().parents]:
        if iteration_of(directory) is not None or (directory / MANIFEST_NAME).exists():
            raise UserError(f"refusing to write {out_dir}: {directory} is a checkpoint's place; choose another")
    if out_dir.name == LATEST_NAME and iter_dirs(out_dir.parent):
        raise UserError(f"refusing to write {out_dir}: it is the checkpoints' pointer to the newest one")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"{out_dir} already exists and is not an empty directory; choose a new one")


def _write_new_directory(out_dir: Path, files: dict) -> None:
    """All files into a temporary directory beside OUT_DIR, then one rename: OUT_DIR is
    whole or absent, and a directory someone filled meanwhile is never replaced (POSIX
    renames a directory only onto an empty one)."""
    _refuse_existing_files(out_dir)
    tmp = out_dir.parent / f"{TMP_PREFIX}{out_dir.name}-{os.getpid()}"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        for name, data in files.items():
            with open(tmp / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, out_dir)
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"cannot write {out_dir}: {error.strerror or error}") from None
