"""GPT (as in GPT-2/nanoGPT), one pipeline stage of it.

The first stage owns the token and position embeddings, the last the final
LayerNorm, the LM head (tied to the token embedding) and the loss; every stage owns
its share of the blocks. With one stage, one object is the whole model. When the
first and last stages differ, each holds a copy of the token embedding, both drawn
from the same (seed, name) and kept equal by summing their gradients over the
embedding group (see `parallel.pipeline.sync_tied_embedding`).
"""

import numpy as np

from numpitron.config import ModelConfig
from numpitron.nn.block import Block
from numpitron.nn.cross_entropy import VocabParallelCrossEntropy
from numpitron.nn.embedding import PositionEmbedding, TiedLMHead, VocabParallelEmbedding
from numpitron.nn.layernorm import LayerNorm
from numpitron.nn.param import ParamStore
from numpitron.distributed.sharding import shard_bounds

TOKEN_EMBEDDING = "embedding.token.weight"


class GPTStage:
    def __init__(self, cfg: ModelConfig, topo, seed: int = 0, pad_multiple: int = 1):
        self.cfg, self.topo = cfg, topo
        self.dtype = np.dtype(cfg.dtype)
        self.first, self.last = topo.is_first_stage, topo.is_last_stage
        self.layer_start, self.layer_stop = shard_bounds(cfg.n_layers, topo.pp, topo.pp_rank)
        params = []
        if self.first or self.last:
            # On the last stage of a pipeline this is the head's copy: counted once in
            # the gradient norm (on the first stage) and saved once.
            self.token_embedding = VocabParallelEmbedding(
                "embedding.token", cfg.vocab_size, cfg.d_model, topo, in_norm=self.first)
            params += self.token_embedding.parameters()
        if self.first:
            self.position_embedding = PositionEmbedding("embedding.position", cfg.seq_len, cfg.d_model)
            params += self.position_embedding.parameters()
        self.blocks = [Block(f"blocks.{i}", cfg.d_model, cfg.n_heads, cfg.n_layers, topo)
                       for i in range(self.layer_start, self.layer_stop)]
        for block in self.blocks:
            params += block.parameters()
        if self.last:
            self.ln_f = LayerNorm("ln_f", cfg.d_model)
            self.head = TiedLMHead(self.token_embedding)
            self.loss_fn = VocabParallelCrossEntropy(cfg.vocab_size, self.token_embedding.vocab_start, topo)
            params += self.ln_f.parameters()
        self.store = ParamStore(params, self.dtype, topo.tp_rank, pad_multiple)
        self.store.initialize(seed)

    @property
    def params(self):
        return self.store.params

    def input_shape(self, B: int, T: int) -> tuple:
        """What this stage receives from the previous one (activations)."""
        return (B * T, self.cfg.d_model)

    def forward(self, inputs, B: int, T: int, targets=None):
        """First stage: inputs are token ids (B, T); others: activations (B*T, C).
        Last stage returns the mean loss (if targets are given) or the logits
        (B*T, V/tp); others the activations (B*T, C) to send on. Returns (output, cache)."""
        cache = {"B": B, "T": T}
        if self.first:
            x, cache["tok"] = self.token_embedding.forward(inputs.reshape(-1))
            x += self.position_embedding.forward(B, T)
        else:
            x = inputs
        cache["blocks"] = []
        for block in self.blocks:
            x, block_cache = block.forward(x, B, T)
            cache["blocks"].append(block_cache)
        if not self.last:
            return x, cache
        h, cache["ln_f"] = self.ln_f.forward(x)
        logits, cache["head"] = self.head.forward(h)
        if targets is None:
            return self.loss_fn.mask_padding(logits), cache
        loss, cache["loss"] = self.loss_fn.forward(logits, targets.reshape(-1))
        return loss, cache

    def backward(self, dout, cache):
        """dout: the loss weight (last stage) or dL/d(output activations). Returns
        dL/d(input activations), or None on the first stage."""
        B, T = cache["B"], cache["T"]
        if self.last:
            dlogits = self.loss_fn.backward(dout, cache["loss"])
            dx = self.ln_f.backward(self.head.backward(dlogits, cache["head"]), cache["ln_f"])
        else:
            dx = dout
        for block, block_cache in zip(reversed(self.blocks), reversed(cache["blocks"])):
            dx = block.backward(dx, block_cache)
        if not self.first:
            return dx
        self.position_embedding.backward(dx, B, T)
        self.token_embedding.backward(dx, cache["tok"])
        return None
