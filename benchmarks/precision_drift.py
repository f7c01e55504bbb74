"""Each precision's training trajectory against float64's (docs/07-numbers.md): the
default model on Tiny Shakespeare, one process, the same batches and initialisation.

    python benchmarks/precision_drift.py --iters 200 [--out drift.json]

Prints, per format, the largest and the final relative difference of the training
loss from float64's, and the validation loss at the end; --out also keeps every loss
curve (benchmarks/figures.py draws them). One process: the drift is the format's
alone, not a layout's (the tests bound that separately).
"""

import argparse
import json

import numpy as np

from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
from numpitron.data.prepare import ensure_prepared
from numpitron.data.prepared import load_prepared
from numpitron.distributed.topology import Topology
from numpitron.build import build_trainer

RUNS = (("float64", "fp32"), ("float32", "fp32"), ("float32", "bf16"), ("float32", "fp16"), ("float32", "fp8"))


def trajectory(dtype: str, precision: str, iters: int, splits: dict, vocab: int, eval_iters: int) -> dict:
    model = ModelConfig(vocab_size=vocab, dtype=dtype).validate()
    train = TrainConfig(max_iters=iters, warmup_iters=min(100, iters // 10), precision=precision).validate()
    trainer = build_trainer(model, ParallelConfig().validate(), train, Topology.serial())
    losses = [trainer.train_step(splits["train"])["train_loss"] for _ in range(iters)]
    val = trainer.evaluate({"val": splits["val"]}, eval_iters)["val"]
    return {"losses": losses, "val_loss": val, "skipped_steps": trainer.scaler.skipped_steps}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--eval-iters", type=int, default=20)
    p.add_argument("--data-dir", default="data")
    p.add_argument("--out", help="a JSON file for every run's loss curve")
    args = p.parse_args()
    tokenizer, splits = load_prepared(ensure_prepared(args.data_dir, quiet=True), ModelConfig().seq_len)
    results = {}
    for dtype, precision in RUNS:
        results[f"{dtype}/{precision}"] = trajectory(dtype, precision, args.iters, splits, tokenizer.vocab_size,
                                                     args.eval_iters)
        if args.out:                    # each run as it finishes: a long sweep keeps what it did
            with open(args.out, "w") as f:
                json.dump({"iters": args.iters, "runs": results}, f)
    exact = np.array(results["float64/fp32"]["losses"])
    summary = {}
    for name, result in results.items():
        drift = np.abs(np.array(result["losses"]) - exact) / exact
        summary[name] = {"max_rel_drift": float(drift.max()), "final_rel_drift": float(drift[-1]),
                         "final_train_loss": result["losses"][-1], "val_loss": result["val_loss"],
                         "skipped_steps": result["skipped_steps"]}
        print(json.dumps({"run": name, **summary[name]}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"iters": args.iters, "runs": results, "summary": summary}, f)


if __name__ == "__main__":
    main()
