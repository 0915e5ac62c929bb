"""Stage 7: serving KDA, the T=1 decode step over a pool of states (chunked prefill and variable lengths to come)."""
