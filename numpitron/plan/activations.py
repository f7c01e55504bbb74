"""The activation bytes a rank's pipeline schedule keeps alive at its peak, from the
configs and the mesh alone (docs/05-pipeline-parallelism.md, docs/06-sequence-parallelism-and-recomputation.md
and docs/11-pipeline-schedules.md derive them); tests compare
them with `PipelineStats.peak_activation_bytes` of a real run, to the byte. A rank is
plan/accounting.py's `Rank`."""

from numpitron.chunk_pairing.executor import choose_pairs, pairs_chunks
from numpitron.distributed.sharding import pad_to_multiple
from numpitron.transformer.activation_memory import block_activation_bytes
from numpitron.pipeline_parallel.schedules import BACKWARD, FORWARD, WEIGHT_GRAD, make_schedule
from numpitron.plan.accounting import Rank
from numpitron.plan.experts import moe_activation_delta
from numpitron.precision.formats import FORMATS


def chunk_activation_bytes(model, parallel, train, rank: Rank, chunk: int = 0) -> int:
    """What one micro-batch's caches keep in one chunk of this stage (chapters 6 and 11
    derive it): its n_layers / (p v) blocks, the embeddings in virtual stage 0, the head
    in the last."""
    item, tp = model.itemsize, rank.tp
    B, T, C = train.micro_batch_size, model.seq_len // rank.cp, model.d_model
    tokens, split = B * T, (tp if parallel.sequence_parallel else 1)
    # A bf16 or fp16 run keeps activations in 2 bytes and statistics (1/std, the
    # log-sum-exps, the loss's probabilities) in fp32 (nn/layer.py).
    fmt = FORMATS[getattr(train, "precision", "fp32")]
    low = fmt.itemsize if fmt.mixed else item
    total = (model.n_layers // rank.stages.stages) * block_activation_bytes(
        B, T, C, model.n_heads, tp, parallel.sequence_parallel, parallel.recompute, low, rank.cp, rank.cp_rank,
        stat_itemsize=item)
    if model.num_experts:               # its MoE blocks keep more (plan/experts.py)
        j, L = rank.stages.stage(rank.stage, chunk), model.n_layers
        total += sum(map(model.is_moe_block, range(j * L // rank.stages.stages, (j + 1) * L // rank.stages.stages))) \
            * moe_activation_delta(model, B, T, tp, rank.ep, parallel.sequence_parallel, parallel.recompute)
    if rank.holds_embeddings(chunk):    # token rows (int64), owned mask (bool), the positions (int64)
        total += 9 * tokens + 8 * T
    if rank.holds_head(chunk):          # ln_f (x-hat, 1/std), the head's input, the loss's probabilities
        n = tokens // split
        total += low * 2 * n * C + item * (n + tokens * pad_to_multiple(model.vocab_size, tp) // tp) + 9 * tokens
    return total


def peak_activation_bytes(model, parallel, train, rank: Rank) -> int:
    """Walk this stage's schedule: a chunk's caches live from its forward to its whole
    backward (BW) or its weight half (W); the peak of their sum. A pair of a forward and
    a backward chunk (chunk_pairing/, with experts) keeps both while it runs."""
    m, alive, peak = train.num_microbatches(rank.dp), 0, 0
    ops = make_schedule(parallel.schedule, m, rank.pp, rank.stage, parallel.virtual_stages)
    groups = choose_pairs(parallel.schedule, m, rank.stages)[rank.stage] if pairs_chunks(model, parallel) \
        else [(i,) for i in range(len(ops))]
    for op in (ops[i] for group in groups for i in sorted(group, key=lambda i: ops[i].action != FORWARD)):
        nbytes = chunk_activation_bytes(model, parallel, train, rank, op.chunk)
        alive += nbytes if op.action == FORWARD else -nbytes if op.action in (BACKWARD, WEIGHT_GRAD) else 0
        peak = max(peak, alive)
    return peak
