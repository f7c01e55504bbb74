"""Tensor parallelism (Shoeybi et al. 2019): column- and row-parallel linear layers, the regions
that hold Megatron's f and g (and sequence parallelism, Korthikanti et al. 2022), and the
vocabulary-parallel embedding, head and loss. Chapter 4 of the book opens this folder."""
