"""Narayanan et al. (2021), Table 1: GPT models from 1.7B to 1T parameters trained on
A100s with tensor x pipeline x data parallelism, full activation recomputation,
micro-batch 1, sequence 2048, vocabulary 51,200. Each row: heads, hidden, layers, t,
p, GPUs, global batch, and the published parameters (billions) and achieved
teraFLOP/s per GPU."""

from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
from numpitron.plan.devices import PAPER
from numpitron.plan.flops import parameter_count
from numpitron.plan.predict import plan

TABLE_1 = [  # params_b, heads, hidden, layers, t, p, gpus, batch, tflops_per_gpu
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
SEQ, VOCAB = 2048, 51200


def reproduce(device_name: str = "a100-80gb-node") -> list[dict]:
    device, rows = PAPER[device_name], []
    for params_b, heads, hidden, layers, t, p, gpus, batch, tflops in TABLE_1:
        dp = gpus // (t * p)
        model = ModelConfig(vocab_size=VOCAB, seq_len=SEQ, n_layers=layers, n_heads=heads, d_model=hidden)
        train = TrainConfig(micro_batch_size=1, global_batch_size=batch)
        result = plan(model, ParallelConfig(recompute="full"), train, (t, p, dp, 1), device)
        predicted = result["hardware_flops_per_iteration"] / (result["step_s"] * gpus) / 1e12
        rows.append({"params_b": params_b, "params_b_eq2": parameter_count(layers, hidden, VOCAB, SEQ) / 1e9,
                     "tflops_paper": tflops, "tflops_predicted": predicted, "error": predicted / tflops - 1,
                     "memory_gb": max(s["total_peak"] for s in result["stages"]) / 1e9, "fits_80gb": result["fits"],
                     "layout": f"t={t} p={p} d={dp} B={batch}"})
    return rows
