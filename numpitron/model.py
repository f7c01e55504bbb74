"""GPT (as in GPT-2/nanoGPT), one pipeline stage of it.

A stage is a sequence of layers that follow the layer contract (nn/layer.py): the
first stage starts with the embeddings, every stage holds its share of the blocks,
the last ends with the language-model head and the loss. With one stage, one object
is the whole model. When the first and last stages differ, each holds a copy of the
token embedding, both drawn from the same (seed, name) and kept equal by summing
their gradients in `finalize_grads`.
"""

import numpy as np

from numpitron.config import ModelConfig
from numpitron.distributed.sharding import shard_bounds
from numpitron.nn.block import Block
from numpitron.nn.embedding import Embeddings, PositionEmbedding, VocabParallelEmbedding
from numpitron.nn.head import LanguageModelHead
from numpitron.nn.kv_cache import KVCache
from numpitron.nn.layer import Layer
from numpitron.nn.param import ParamStore
from numpitron.nn.recompute import Recomputed
from numpitron.nn.regions import make_region
from numpitron.parallel.context import local_positions

TOKEN_EMBEDDING = "embedding.token.weight"


class GPTStage(Layer):
    """This rank's layers: one chunk per virtual stage it holds (one without
    interleaving). Chunk c of pp rank r is virtual stage c*p + r of p*v, and holds
    that share of the blocks; the embeddings open virtual stage 0, the head closes
    the last. Block names stay global (`blocks.5...`), whichever rank holds them."""

    def __init__(self, model_cfg: ModelConfig, topo, seed: int = 0, sequence_parallel: bool = False,
                 recompute: str = "none", virtual_stages: int = 1):
        self.model_cfg, self.topo, self.virtual_stages = model_cfg, topo, virtual_stages
        self.region = make_region(topo, sequence_parallel)
        self.dtype = np.dtype(model_cfg.dtype)
        self.first, self.last = topo.is_first_stage, topo.is_last_stage    # holds the embeddings, the head
        self.tied = []
        if self.first or self.last:
            # On the last stage of a pipeline this is the head's copy: counted once in
            # the gradient norm (on the first stage) and saved once.
            self.token_embedding = VocabParallelEmbedding(
                "embedding.token", model_cfg.vocab_size, model_cfg.d_model, topo, in_norm=self.first,
                region=self.region)
            self.tied = self.token_embedding.parameters()
        if self.first:
            position = PositionEmbedding("embedding.position", model_cfg.seq_len, model_cfg.d_model)
            positions = local_positions(model_cfg.seq_len, topo.cp, topo.cp_rank)
            self.embeddings = Embeddings(self.token_embedding, position, positions)
        if self.last:
            self.head = LanguageModelHead(self.token_embedding, model_cfg.d_model, topo)
        self.blocks, self.chunk_blocks, self.chunks = [], [], []
        for chunk in range(virtual_stages):
            start, stop = shard_bounds(model_cfg.n_layers, topo.pp * virtual_stages, chunk * topo.pp + topo.pp_rank)
            blocks = [Block(f"blocks.{i}", model_cfg.d_model, model_cfg.n_heads, model_cfg.n_layers, topo,
                            self.region, keep_probs=recompute != "selective") for i in range(start, stop)]
            # Full recomputation keeps each block's input only (nn/recompute.py).
            block_layers = [Recomputed(b) for b in blocks] if recompute == "full" else blocks
            self.blocks += blocks
            self.chunk_blocks.append(block_layers)
            self.chunks.append(([self.embeddings] if self.opens(chunk) else []) + block_layers
                               + ([self.head] if self.closes(chunk) else []))
        self.layers = [layer for chunk_layers in self.chunks for layer in chunk_layers]
        # Every parameter once, in forward order (the tied copy heads the list).
        params = self.tied + [p for layer in self.layers for p in layer.parameters() if p not in self.tied]
        self.store = ParamStore(params, self.dtype, topo.tp_rank)
        self.store.initialize(seed)

    def opens(self, chunk: int) -> bool:
        """Whether `chunk` is virtual stage 0: it starts with the embeddings."""
        return self.first and chunk == 0

    def closes(self, chunk: int) -> bool:
        """Whether `chunk` is the last virtual stage: it ends with the head and the loss."""
        return self.last and chunk == self.virtual_stages - 1

    def parameters(self):
        return self.store.params

    def input_shape(self, B: int, T: int) -> tuple:
        """What a chunk receives from the previous virtual stage: activations (B, T, C),
        the sequence split over tp when sequence-parallel."""
        return (B, T // self.region.parts, self.model_cfg.d_model)

    def forward(self, inputs, targets=None, kv: KVCache | None = None, chunk: int = 0):
        """inputs: token ids (B, T) into virtual stage 0, activations (B, T, C) elsewhere.
        Returns (output, cache): the last virtual stage's output is the mean loss, or
        the logits (B, T, V/tp) without targets; the others' are activations to send on."""
        caches, x = [], inputs
        if self.opens(chunk):
            x, layer_cache = self.embeddings.forward(x, kv=kv)
            caches.append(layer_cache)
        for i, block in enumerate(self.chunk_blocks[chunk]):
            x, layer_cache = block.forward(x, kv=None if kv is None else kv.layer(i))
            caches.append(layer_cache)
        if self.closes(chunk):
            x, layer_cache = self.head.forward(x, targets=targets)
            caches.append(layer_cache)
        if kv is not None:
            kv.advance(inputs.shape[1])
        return x, caches

    def backward(self, dout, cache, grads_ready=None, chunk: int = 0):
        """dout: the loss weight (last virtual stage) or dL/d(output activations). Returns
        dL/d(input activations), None on virtual stage 0. Layer by layer, both halves,
        so each layer's gradients are final as early as possible: `grads_ready` hears
        of them (data parallelism starts reducing them while the backward goes on)."""
        for layer, layer_cache in zip(reversed(self.chunks[chunk]), reversed(cache)):
            dout = layer.backward(dout, layer_cache)
            self._report(layer, grads_ready)
        return dout

    def backward_input(self, dout, cache, chunk: int = 0):
        """The input half over the chunk (B of a zero-bubble schedule): the gradient the
        previous virtual stage waits for. No weight gradient changes."""
        for layer, layer_cache in zip(reversed(self.chunks[chunk]), reversed(cache)):
            dout = layer.backward_input(dout, layer_cache)
        return dout

    def backward_weights(self, cache, grads_ready=None, chunk: int = 0):
        """The weight half over the chunk (W), any time after its input half; reports
        each layer's gradients final as `backward` does."""
        for layer, layer_cache in zip(reversed(self.chunks[chunk]), reversed(cache)):
            layer.backward_weights(layer_cache)
            self._report(layer, grads_ready)

    def _report(self, layer, grads_ready) -> None:
        if grads_ready is not None:
            # The tied embedding is not final before finalize_grads sums its copies.
            grads_ready([p for p in layer.parameters() if p not in self.tied])

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
            self.topo.embedding_comm.all_reduce(self.token_embedding.weight.grad)
            grads_ready(self.tied)

    def new_kv_cache(self, batch: int, chunk: int = 0) -> KVCache:
        """An empty key/value cache for generating `batch` sequences through a chunk."""
        heads = self.model_cfg.n_heads // self.topo.tp
        return KVCache(len(self.chunk_blocks[chunk]), batch, heads, self.model_cfg.seq_len, self.model_cfg.head_dim,
                       self.dtype)
