"""Stage 2: chunked linear attention with scalar decay, S_t = alpha S_{t-1} + v_t k_t^T, o_t = S_t q_t."""
