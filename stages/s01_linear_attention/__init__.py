"""Stage 1: chunked linear attention, S_t = S_{t-1} + v_t k_t^T, o_t = S_t q_t."""
