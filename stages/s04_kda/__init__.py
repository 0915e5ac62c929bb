"""Stage 4: Kimi Delta Attention, S_t = S_{t-1} Diag(a_t)(I - beta_t k_t k_t^T) + beta_t v_t k_t^T, o_t = S_t q_t."""
