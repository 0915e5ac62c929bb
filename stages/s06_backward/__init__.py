"""Stage 6: the backward pass, the gradients of KDA's output and final state with respect to q, k, v, g, beta and S_0."""
