"""Number formats of a mixed-precision run (Micikevicius et al. 2018) and FP8 matmuls: wrappers
installed on the model and the optimizer, not threaded through the layers. Chapter 7 of the
book opens this folder."""
