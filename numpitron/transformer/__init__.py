"""The transformer's layers, built from the strategies' pieces: attention (tensor-parallel
projections around context parallelism's attention), the MLP (a column then a row layer), the
block, the last stage's head and loss; and the bytes a block keeps for its backward."""
