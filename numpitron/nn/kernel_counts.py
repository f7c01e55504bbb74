"""What each tuned kernel executes, counted by hand beside the kernels: its element-wise
passes (one NumPy kernel over the array it works on), its exponentials, and its NumPy
calls on per-row or per-parameter vectors. Change a kernel, change its line here.

The planner prices these counts (plan/kernels.py, docs/15-planning-a-run.md);
tests/test_plan_time_model.py checks the exponentials against a real step.
"""

# (forward, backward) element-wise passes of each piece, over the array it works on.
PASSES = {
    "layernorm": (7, 10),        # layernorm.py, over n x C: row sum, centre, square, row sum, scale, weight,
    #                              bias / dy*x-hat, two column sums, two row sums, g, two subtractions,
    #                              product, scale
    "gelu": (14, 1),             # functional.py, over n x 4C/tp, bias included: bias, u = s (x + a x^3) in
    #                              four, 1 + e, 1 / (1 + e), x sig, the slope from x^2, sig and y in six /
    #                              dy * slope
    "softmax": (4, 2),           # blockwise_attention.py, over each group's scores: max, subtract, row sum,
    #                              normalise / dS -= D, dS *= P
    "merge": 3,                  # blockwise_attention.py, over a later group's output: rescale the running
    #                              output and the new one, add
    "heads": (5, 11),            # attention.py, over n x C/tp: split q|k|v, scale q, merge / D = rowsum(dO O)
    #                              (2), dO copy, zero dq|dk|dv (3), dq scale, dq|dk|dv copy (3)
    "embedding": 3,              # embedding.py, over n x C: gather token rows, mask the rows others own,
    #                              add the positions
    "one_hot": 2,                # embedding.py, over n x V/tp: the one-hot matrix of the token gradient
    "loss": (4, 2),              # cross_entropy.py, over n x V/tp: max, subtract, sum, divide / subtract
    #                              the target, scale
    "adamw": 13,                 # optim/adamw.py, over each updated element, the decay counted as one
    "grads": 3,                  # over the rank's gradient buffer: the norm's dot (optim/grad_norm.py, run
    #                              by run), clip, zeroing
}
EXP_PER_ELEMENT = {"gelu": 1, "softmax": 1, "loss": 1}      # np.exp per hidden unit, score, logit
# NumPy calls on per-row or per-parameter vectors, besides the passes above.
SMALL_CALLS = {"layernorm": (5, 2), "softmax_group": (4, 3), "merge": 4, "block": 12, "head": 6, "embedding": 6}
