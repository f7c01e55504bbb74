"""GPT (as in GPT-2/nanoGPT), one pipeline stage of it.

A stage is a sequence of layers that follow the layer contract (nn/layer.py): the
first stage starts with the embeddings, every stage holds its share of the blocks,
the last ends with the language-model head and the loss. With one stage, one object
is the whole model. When the first and last stages differ, each holds a copy of the
token embedding, both drawn from the same (seed, name) and kept equal by summing
their gradients in `finalize_grads`. Which rank holds which virtual stage is the
`placement`'s to say (pipeline_parallel/placement.py): in a V, the first and the last are both
on pp rank 0, which then holds the one token embedding for both.

Parameters live in two flat buffers: `store` for those every data-parallel rank
holds, `expert_store` for this rank's experts (empty without experts), whose
gradients are averaged over a different group (docs/13-experts.md). `stores` lists
the ones in use.

Features wrap the stage instead of living in it: the experts come built and hold their
routing state (experts/stage_experts.py; build.py gives them), a mixed-precision run
installs its number format (precision/formats.py, `use_format`), FP8 its matmuls
(precision/fp8.py), ZeRO-3 its residency hooks (data_parallel/zero3.py), generation its
key/value cache (generate.py).
"""

import numpy as np

from numpitron.context_parallel.zigzag import local_positions
from numpitron.distributed.sharding import shard_bounds, shard_size
from numpitron.transformer.block import Block
from numpitron.nn.embedding import Embeddings, PositionEmbedding
from numpitron.transformer.head import LanguageModelHead
from numpitron.nn.layer import FULL_PRECISION, Layer
from numpitron.nn.param_store import ParamStore
from numpitron.nn.recompute import Recomputed
from numpitron.nn.residency import AlwaysResident
from numpitron.pipeline_parallel.placement import StagePlacement
from numpitron.tensor_parallel.regions import make_region
from numpitron.tensor_parallel.vocab_parallel import VocabParallelEmbedding

TOKEN_EMBEDDING = "embedding.token.weight"


class GPTStage(Layer):
    """This rank's layers: one chunk per virtual stage it holds (one without
    interleaving). Chunk c of pp rank r is virtual stage `placement.stage(r, c)` of
    p*v (c*p + r, or in a V r and 2p-1-r), and holds that share of the blocks; the
    embeddings open virtual stage 0, the head closes the last. Block names stay global
    (`blocks.5...`), whichever rank holds them."""

    def __init__(self, model_cfg, topo, seed: int = 0, sequence_parallel: bool = False,
                 recompute: str = "none", loss_weight: float = 1.0, virtual_stages: int = 1,
                 tp_comm_overlap: bool = True, v_shape: bool = False, experts=None):
        """model_cfg: a config.ModelConfig; loss_weight: the weight the schedule gives each
        micro-batch's loss (1/m); the last stage's head receives it as its output gradient,
        every MoE layer scales its aux loss's gradient by it. v_shape: the chunks placed in
        a V (ZB-V, DualPipeV) instead of a loop. experts: the stage's experts
        (experts/stage_experts.py), or None: every block's MLP is dense."""
        self.model_cfg, self.topo, self.experts = model_cfg, topo, experts
        self.loss_weight = loss_weight
        self.virtual_stages = virtual_stages
        self.placement = StagePlacement(topo.pp, virtual_stages, v_shape)
        self.region = make_region(topo, sequence_parallel, tp_comm_overlap)
        self.dtype = np.dtype(model_cfg.dtype)
        # Holds the embeddings (virtual stage 0), the head (the last virtual stage).
        self.first = self.placement.rank_of(0) == topo.pp_rank
        self.last = self.placement.rank_of(self.placement.stages - 1) == topo.pp_rank
        self._build_embeddings_and_head()
        self._build_chunks(recompute)
        # Every parameter once, in forward order (the tied copy heads the list).
        params = self.tied + [p for layer in self.layers for p in layer.parameters() if p not in self.tied]
        self._build_stores(params, seed)
        self.summed_in_finalize = self._summed_in_finalize(params)
        self.residency = AlwaysResident()       # ZeRO-3 installs its own (nn/residency.py)
        self.precision = FULL_PRECISION         # a mixed run installs its format (precision/formats.py)

    def _build_embeddings_and_head(self) -> None:
        """The token embedding on the first and the last stage (`tied`: the head's copy
        there), the embeddings on the first, the head on the last."""
        c, topo = self.model_cfg, self.topo
        self.tied = []
        if self.first or self.last:
            # On the last stage of a pipeline this is the head's copy: counted once in
            # the gradient norm (on the first stage) and saved once.
            self.token_embedding = VocabParallelEmbedding(
                "embedding.token", c.vocab_size, c.d_model, topo, in_norm=self.first, region=self.region)
            self.tied = self.token_embedding.parameters()
        if self.first:
            position = PositionEmbedding("embedding.position", c.seq_len, c.d_model)
            self.embeddings = Embeddings(self.token_embedding, position, local_positions(c.seq_len, topo.cp,
                                                                                         topo.cp_rank))
        if self.last:
            self.head = LanguageModelHead(self.token_embedding, c.d_model, topo)

    def _build_chunks(self, recompute: str) -> None:
        """This rank's share of the blocks, chunk by chunk (virtual stage c*p + r), each
        chunk's layer list with the embeddings and the head where they belong, and
        `layers`: every chunk's layers in order (the index the residency hooks take)."""
        c, topo, v = self.model_cfg, self.topo, self.virtual_stages
        self.blocks, self.chunk_blocks, self.chunks = [], [], []
        for chunk in range(v):
            start, stop = shard_bounds(c.n_layers, self.placement.stages, self.placement.stage(topo.pp_rank, chunk))
            blocks = [Block(f"blocks.{i}", c.d_model, c.n_heads, c.n_layers, topo, self.region,
                            keep_probs=recompute != "selective", mlp=self._experts_of(i))
                      for i in range(start, stop)]
            # Full recomputation keeps each block's input only (nn/recompute.py).
            block_layers = [Recomputed(b) for b in blocks] if recompute == "full" else blocks
            self.blocks += blocks
            self.chunk_blocks.append(block_layers)
            self.chunks.append(([self.embeddings] if self.holds_embeddings(chunk) else []) + block_layers
                               + ([self.head] if self.holds_head(chunk) else []))
        self.layers = [layer for chunk_layers in self.chunks for layer in chunk_layers]
        self.chunk_offsets = [sum(len(layers) for layers in self.chunks[:k]) for k in range(v)]

    def _build_stores(self, params, seed: int) -> None:
        """The two flat buffers (the experts apart: averaged over another group), each
        parameter drawn in full from (seed, name) and cut to this rank's slice."""
        experts = self.experts.parameters() if self.experts else []
        self.store = ParamStore([p for p in params if p not in experts], self.dtype, self.topo.tp_rank)
        self.expert_store = ParamStore(experts, self.dtype, self.topo.tp_rank)
        self.stores = [self.store] + ([self.expert_store] if experts else [])
        for store in self.stores:
            store.initialize(seed)

    @property
    def loss_weight(self) -> float:
        return self._loss_weight

    @loss_weight.setter
    def loss_weight(self, weight: float) -> None:
        """The weight of each micro-batch's loss, 1/m. A ramp-up (--rampup-batch-size)
        changes m from step to step; the experts' routers scale their aux loss by it too."""
        self._loss_weight = weight
        if self.experts:
            self.experts.set_loss_weight(weight)

    def _summed_in_finalize(self, params) -> list:
        """The parameters whose gradients are final only after `finalize_grads`: the tied
        embedding (summed over its copies) and, with sequence parallelism, the
        tp-replicated ones (summed over tp). Nobody may start reducing them over dp
        before that."""
        replicated = [p for p in params if p.split_axis is None] if self.region.sequence_parallel else []
        return self.tied + [p for p in replicated if p not in self.tied]

    def _experts_of(self, block: int):
        """Block `block`'s mixture of experts, or None: its MLP is the dense one."""
        return self.experts.mlp(block, f"blocks.{block}.mlp", Block.out_std(self.model_cfg.n_layers), self.region,
                                self.loss_weight) if self.experts else None

    def holds_embeddings(self, chunk: int) -> bool:
        """Whether `chunk` is virtual stage 0: it starts with the embeddings."""
        return self.placement.stage(self.topo.pp_rank, chunk) == 0

    def holds_head(self, chunk: int) -> bool:
        """Whether `chunk` is the last virtual stage: it ends with the head and the loss."""
        return self.placement.stage(self.topo.pp_rank, chunk) == self.placement.stages - 1

    @property
    def head_rank(self) -> int:
        """The pp rank whose head computes the loss (the last; rank 0 in a V)."""
        return self.placement.rank_of(self.placement.stages - 1)

    def tied_group(self):
        """The ranks holding a copy of the token embedding, whose gradients are summed:
        the first and the last pp rank (the topology's embedding group), or this rank
        alone when it holds both ends (one process, or the V), one copy for both."""
        return self.topo.alone("embedding") if self.first and self.last else self.topo.embedding_comm

    def parameters(self):
        return [p for store in self.stores for p in store.params]

    def whole_backward_layers(self) -> list:
        """The layers with only a whole backward, which a zero-bubble schedule cannot split."""
        return [layer for layer in self.layers if not layer.splits_backward()]

    def input_shape(self, B: int, T: int) -> tuple:
        """What a chunk receives from the previous virtual stage: activations (B, T, C),
        the sequence split over tp when sequence-parallel."""
        return (B, shard_size(T, self.region.parts), self.model_cfg.d_model)

    def forward(self, inputs, targets=None, kv=None, chunk: int = 0):
        """inputs: token ids (B, T) into virtual stage 0, activations (B, T, C) elsewhere.
        Returns (output, cache): the last virtual stage's output is the mean loss, or
        the logits (B, T, V/tp) without targets; the others' are activations to send on."""
        caches, x = [], inputs
        offset = self.chunk_offsets[chunk]
        for i, layer in enumerate(self.chunks[chunk]):
            self.residency.before_forward(offset + i)
            x, layer_cache = layer.forward(x, **self._context(chunk, i, targets, kv))
            self.residency.after_forward(offset + i)
            x = self._round(x)                  # the next layer keeps it in the low format
            caches.append(layer_cache)
        if kv is not None:
            kv.advance(inputs.shape[1])
        return x, caches

    def _round(self, x):
        """Activations and their gradients, as one layer hands them to the next, in the
        low format of a mixed-precision run (the loss and fp32 runs: unchanged)."""
        return self.precision.round(x) if isinstance(x, np.ndarray) and x.ndim > 0 else x

    def _context(self, chunk: int, i: int, targets, kv) -> dict:
        """What layer i of a chunk takes beside its input: the head the targets, the
        embeddings the KV cache (for positions), each block its own layer's cache."""
        if self.holds_head(chunk) and i == len(self.chunks[chunk]) - 1:
            return {"targets": targets}
        if kv is None:
            return {}
        return {"kv": kv if self.holds_embeddings(chunk) and i == 0 else kv.layer(i - self.holds_embeddings(chunk))}

    def backward(self, dout, cache, grads_ready=None, chunk: int = 0):
        """dout: the loss weight (last virtual stage) or dL/d(output activations). Returns
        dL/d(input activations), None on virtual stage 0. Layer by layer, both halves,
        so each layer's gradients are final as early as possible: `grads_ready` hears
        of them (data parallelism starts reducing them while the backward goes on).
        The residency hooks take the layer's index in `layers` (ZeRO-3 gathers it)."""
        offset = self.chunk_offsets[chunk]
        for i in reversed(range(len(self.chunks[chunk]))):
            layer = self.chunks[chunk][i]
            self.residency.before_backward(offset + i)
            dout = self._round(layer.backward(dout, cache[i]))
            self.residency.after_backward(offset + i)
            self._report(layer, grads_ready)
        return dout

    def backward_input(self, dout, cache, chunk: int = 0):
        """The input half over the chunk (B of a zero-bubble schedule): the gradient the
        previous virtual stage waits for. No weight gradient changes."""
        for layer, layer_cache in zip(reversed(self.chunks[chunk]), reversed(cache)):
            dout = self._round(layer.backward_input(dout, layer_cache))
        return dout

    def backward_weights(self, cache, grads_ready=None, chunk: int = 0):
        """The weight half over the chunk (W), any time after its input half; reports
        each layer's gradients final as `backward` does."""
        for layer, layer_cache in zip(reversed(self.chunks[chunk]), reversed(cache)):
            layer.backward_weights(layer_cache)
            self._report(layer, grads_ready)

    def _report(self, layer, grads_ready) -> None:
        if grads_ready is not None:
            grads_ready([p for p in layer.parameters() if p not in self.summed_in_finalize])

    def finalize_grads(self, grads_ready) -> None:
        """After the last micro-batch's backward (Megatron's finalize_model_grads). With
        sequence parallelism every tp-replicated parameter (LayerNorms, row-parallel
        biases, positions) saw only this rank's tokens: its gradient is summed over tp.
        Then the tied token embedding's gradient is summed over its copies on the first
        and last stage, so both apply the same update and never drift apart."""
        if self.region.sequence_parallel:
            replicated = [p for p in self.store.params if p.split_axis is None]
            partial = np.concatenate([p.grad.reshape(-1) for p in replicated])
            self.topo.tp_comm.all_reduce(partial)        # one message for all of them
            offset = 0
            for p in replicated:
                p.grad.reshape(-1)[...] = partial[offset:offset + p.grad.size]
                offset += p.grad.size
        if self.tied:
            self.tied_group().all_reduce(self.token_embedding.weight.grad)
        grads_ready(self.summed_in_finalize)
