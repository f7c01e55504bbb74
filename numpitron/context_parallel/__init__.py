"""Context parallelism: attention block by block with an online softmax, the ring that passes
key/value blocks (Liu et al. 2023), the zigzag split of a sequence, and Ulysses' head exchange
(Jacobs et al. 2023). Chapter 12 of the book opens this folder."""
