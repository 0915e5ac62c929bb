"""The fast path of KDA as one kernel library, split by role as FLA splits an op (fla/ops/kda):

    config      the sizes a call runs with: constants, defaults, the resolved KernelConfig
    tiles       the tile pieces the kernels share (every @T.macro), and the prepare's buffers
    tensor_types  the tensors the chunked kernels take, each declared once for their signatures
    prepare     the prepare kernel: dense or packed batches, value flags, the solve's outputs
    recurrence  the chunk recurrence: dense or packed batches
    backward    the backward's kernels: states, state gradient, state products, intra
    activation  the backward's elementwise kernels for raw tensors: the form's activation, its chain rule
    decode      the T = 1 step over a pool of states
    compiled    the programs compiled for the GPU, once per shape; compile-only reports
    on_cpu      the calls on a machine without a GPU: each program interpreted, or compiled ahead only
    checks      the calls' input checks
    calls       the public calls: forward, backward, prefill, decode
    fla_options FLA's options of chunk_kda and fused_recurrent_kda: the InputForm they make, FLA's rules
    packing     shapes the kernels do not take (packed batches, head dims, grouped heads) made dense, exactly
    autograd    chunk_kda, FLA 0.6.0's whole signature, as a torch.autograd.Function
    fused_recurrent  fused_recurrent_kda and fused_recurrent_kda_fwd: token by token, pools of states
    fla_backend the kernels registered as a backend of FLA (one import)
    layer       a KDA layer that trains

Stages 5-7 teach it (their references mirror it, their pages carve its code).
"""
