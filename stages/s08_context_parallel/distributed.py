"""Stage 8: KDA over R processes with torch.distributed, forward and backward, in FLA's cp_context convention.

    S_t = S_{t-1} Diag(a_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T        o_t = S_t q_t
                                                             (paper layout: S is d_v x d_k)

One process per rank. A packed batch (FLA's convention: q, k, g (1, T, H, d_k), v (1, T, H, d_v), beta
(1, T, H) and `cu_seqlens` over the whole batch) is cut into R contiguous parts (`reference.split_over_ranks`),
and rank r holds only its part: `build_cp_context(cu_seqlens)` says which, and
`chunk_kda_cp(q, k, v, g, beta, cp_context)` runs it. The result is one device's pass over the whole
batch: float64 on the CPU, exact to rounding; on CUDA within the kernels' bf16 rounding.

Each sequence of a rank runs through the course's KDA on the rank's device, whole:

    CUDA tensors   stage 5's forward kernels and stage 6's backward kernels (stages.kda.calls.forward /
                   backward, with initial_state and d_final_state)
    CPU tensors    chunk_kda's CPU path, the float64 references (stages.kda.autograd.chunk_kda)

and the ranks meet only where a sequence crosses a boundary, in three steps (reference B's):

    forward   1. each rank alone: the sequences whose initial states it knows; for the one it hands on,
                 its final state from zero Z and, if the rank received that sequence too, its map A
                 (the final state the identity becomes with the values removed: v = 0, S_0^T = I)
              2. the pass (`reference.pass_states`): receive S_in from the rank before, send A S_in + Z
                 to the rank after (combine="pass": point-to-point, rank after rank), or all-gather
                 every rank's (A, Z) and compose the ranks before (combine="gather", FLA's way)
              3. the sequence it received, again, from S_in: the pass from zero plus the correction in
                 one call (the kernels read the state anyway)
    backward  the same steps from the last rank: the gradient of the incoming state through the rank's
              own outputs (1), passed back through A^T (2, `reference.pass_state_gradients`), and the
              sequence handed on, again, with both its gradients (3)

A state, or its gradient, is H * d_k * d_v fp32 numbers (2 MiB at H = 32, d = 128): one message per
boundary a sequence crosses, each way.

States are indexed by the sequences of the whole batch: `initial_state` (N_seq, H, d_k, d_v), each rank
reading the rows of the sequences that begin on it; the final states come back in that shape, each rank
writing the rows of the sequences that end on it and zeros elsewhere (summed over the ranks, they are
one device's). q and k are taken as the kernels take them: chunk_kda's scale and L2 norm go in front,
as they do for one device.
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from stages.kda import autograd as one_device
from stages.kda import calls
from stages.kda.config import resolve_for
from stages.s08_context_parallel.reference import RankPart, pass_state_gradients, pass_states, split_over_ranks

COMBINES = ("pass", "gather")


# --8<-- [start:context]
@dataclass(frozen=True)
class CPContext:
    """What one rank knows of the split: its part of the packed batch, and whom it talks to."""

    group: "dist.ProcessGroup | None"  # the ranks' process group (None: the default group)
    rank: int  # this process's rank in the group
    world_size: int  # R
    part: RankPart  # its tokens and sequences (reference.split_over_ranks)
    num_sequences: int  # N_seq of the whole batch
    combine: str = "pass"  # "pass": rank after rank, point-to-point; "gather": all-gather the summaries

    @property
    def cu_seqlens(self) -> np.ndarray:
        return self.part.cu_seqlens

    def chunk_kda(self, q, k, v, g, beta, initial_state=None, output_final_state=False, chunk_size=None,
                  checks="device"):
        """chunk_kda_cp on this context: what stages.kda.autograd.chunk_kda(..., cp_context=self) runs
        once it has made q, k, g and beta the recurrence's own."""
        return chunk_kda_cp(q, k, v, g, beta, self, initial_state, output_final_state, chunk_size, checks)


def build_cp_context(cu_seqlens, group: "dist.ProcessGroup | None" = None, combine: str = "pass") -> CPContext:
    """The context of this process's rank for the packed batch `cu_seqlens` (N_seq + 1,) of the whole
    batch (a tensor or an integer array), split over the group's ranks as `reference.split_over_ranks`
    splits it. torch.distributed must be initialized (dist.init_process_group)."""
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
    if not dist.is_initialized():
        raise RuntimeError("build_cp_context needs torch.distributed: call dist.init_process_group first")
    offsets = np.asarray(cu_seqlens.cpu() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens).astype(np.int64)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    part = split_over_ranks(offsets, world_size)[rank]
    return CPContext(group, rank, world_size, part, len(offsets) - 1, combine)
# --8<-- [end:context]


# --8<-- [start:chunk_kda_cp]
def chunk_kda_cp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 cp_context: CPContext, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                 chunk_size: int | None = None, checks: str = "device") -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA on this rank's part of a packed batch, with autograd. Returns (o (1, n, H, d_v), the final
    states (N_seq, H, d_k, d_v) of the sequences that end on this rank, zeros elsewhere, or None).

    q, k, g: (1, n, H, d_k), v: (1, n, H, d_v), beta: (1, n, H): the rank's n tokens, as chunk_kda
    takes them (on CUDA q, k, v in fp16 or bf16, g and beta fp32); initial_state: (N_seq, H, d_k, d_v)
    for the whole batch, or None for zeros. chunk_size and checks: as chunk_kda's. Every rank of the
    group must call it, with its own part.
    """
    check_cp_inputs(q, k, v, g, beta, cp_context, initial_state)
    o, final_states = ChunkKDACPFunction.apply(q, k, v, g, beta, initial_state, cp_context, chunk_size, checks)
    return o, (final_states if output_final_state else None)
# --8<-- [end:chunk_kda_cp]


# --8<-- [start:function]
class ChunkKDACPFunction(torch.autograd.Function):
    """(q, k, v, g, beta, initial_state, cp_context, chunk_size, checks) -> (o, final states), and the way
    back; the three steps of the module's docstring each way."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, context, chunk_size, checks):
        ctx.set_materialize_grads(False)
        run = _Sequences(q, k, v, g, beta, initial_state, context, chunk_size, checks)
        part = context.part
        o, finals = torch.zeros_like(v), [None] * run.count
        # 1. alone: every sequence whose initial state this rank knows, then its summary for the pass
        for i in run.known_start:
            o[:, run.rows(i)], finals[i] = run.forward(i, run.start(i))
        transition, zero_state = run.zero_map(), run.zero_state_like()
        if part.sends:
            if run.relayed:  # the sequence it receives is the one it hands on
                zero_state = run.forward(run.sent, run.zero_state_like()[None])[1][0]
                transition = run.forward(run.sent, run.identity(), values=False)[1][0]
            else:
                zero_state = finals[run.sent][0]
        # 2. the pass
        incoming = _combine_states(context, transition, zero_state)
        # 3. the sequence it received, from the state handed to it
        if part.receives:
            o[:, run.rows(0)], finals[0] = run.forward(0, incoming[None])
        ctx.save_for_backward(q, k, v, g, beta, initial_state, incoming, transition)
        ctx.context, ctx.chunk_size, ctx.checks = context, chunk_size, checks
        return o, run.final_states(finals)

    @staticmethod
    def backward(ctx, do, d_final_states):
        q, k, v, g, beta, initial_state, incoming, transition = ctx.saved_tensors
        context, part = ctx.context, ctx.context.part
        run = _Sequences(q, k, v, g, beta, initial_state, context, ctx.chunk_size, ctx.checks, incoming)
        do = torch.zeros_like(v) if do is None else do
        grads = [torch.zeros_like(x, dtype=torch.promote_types(x.dtype, torch.float32)) for x in (q, k, v, g, beta)]
        d_starts = [None] * run.count

        def backward(i, d_final):
            *sequence_grads, d_starts[i] = run.backward(i, do, d_final)
            for grad, sequence_grad in zip(grads, sequence_grads):
                grad[:, run.rows(i)] = sequence_grad

        # 1. alone: every sequence but the one handed on; for a relayed one, its incoming gradient
        for i in range(run.count):
            if i != run.sent:
                backward(i, run.d_final(i, d_final_states))
            elif run.relayed:
                d_starts[i] = run.backward(i, do, run.zero_state_like()[None])[-1]
        d_incoming = d_starts[0][0] if part.receives else run.zero_state_like()
        # 2. the pass backwards
        d_outgoing = _combine_gradients(context, transition if run.relayed else run.zero_map(), d_incoming)
        # 3. the sequence handed on, with the gradient of what it handed on
        if part.sends:
            backward(run.sent, d_outgoing[None])
        d_initial_state = None if initial_state is None else run.initial_gradients(d_starts)
        return *(grad.to(x.dtype) for grad, x in zip(grads, (q, k, v, g, beta))), d_initial_state, None, None, None
# --8<-- [end:function]


class _Sequences:
    """A rank's sequences on its device: their rows, their initial states, and one call of the course's
    KDA on one of them, forward or backward. `incoming`: the state the rank received (the backward's)."""

    def __init__(self, q, k, v, g, beta, initial_state, context, chunk_size, checks, incoming=None):
        self.inputs, self.initial_state, self.chunk_size = (q, k, v, g, beta), initial_state, chunk_size
        self.checks = checks
        self.part, self.num_sequences, self.incoming = context.part, context.num_sequences, incoming
        self.count = len(self.part.sequences)
        self.H, self.d_k, self.d_v = q.shape[2], q.shape[3], v.shape[3]
        # the kernels' states are fp32; the CPU's as chunk_kda's CPU path keeps them: float64 for float64 inputs
        self.state_dtype = torch.float32 if q.is_cuda else torch.promote_types(
            torch.promote_types(q.dtype, torch.float32), torch.float32 if initial_state is None else initial_state.dtype)
        self.sent = self.count - 1 if self.part.sends else None  # the sequence it hands on
        self.relayed = self.part.receives and self.part.sends and self.count == 1  # received and handed on
        self.known_start = [i for i in range(self.count) if not (i == 0 and self.part.receives)]

    def rows(self, i):
        return slice(int(self.part.cu_seqlens[i]), int(self.part.cu_seqlens[i + 1]))

    def zero_state_like(self):
        return self.inputs[0].new_zeros((self.H, self.d_k, self.d_v), dtype=self.state_dtype)

    def zero_map(self):
        return self.inputs[0].new_zeros((self.H, self.d_k, self.d_k), dtype=self.state_dtype)

    def identity(self):
        return torch.eye(self.d_k, dtype=self.state_dtype, device=self.inputs[0].device).expand(1, self.H, -1, -1)

    def start(self, i):
        """S_0^T (1, H, d_k, d_v) of local sequence i: the incoming state, its own initial state, or zeros."""
        if i == 0 and self.part.receives:
            return self.incoming[None]
        if self.initial_state is None:
            return self.zero_state_like()[None]
        return self.initial_state[self.part.sequences[i]][None].to(self.state_dtype)

    def d_final(self, i, d_final_states):
        """dL/dS_N^T (1, H, d_k, d_v) of local sequence i, which ends on this rank."""
        if d_final_states is None:
            return self.zero_state_like()[None]
        return d_final_states[self.part.sequences[i]][None].to(self.state_dtype)

    def forward(self, i, initial_state, values=True):
        """(o (1, n_i, H, d_v), final state (1, H, d_k, d_v)) of local sequence i from initial_state;
        values=False: with v = 0 and d_k value columns (the map: initial_state is the identity)."""
        q, k, v, g, beta = (x[:, self.rows(i)] for x in self.inputs)
        if not values:
            v = q.new_zeros(q.shape)
        if q.shape[1] == 0:  # an empty sequence: no output, the state as it came
            return v.new_zeros(v.shape), initial_state
        if q.is_cuda:
            return calls.forward(q, k, v, g.float(), beta.float(), initial_state.float().contiguous(),
                                 output_final_state=True, checks=self.checks, config=self._config(v))
        return one_device.chunk_kda(q, k, v, g, beta, scale=1.0, initial_state=initial_state,
                                    output_final_state=True, **self._chunk())

    def backward(self, i, do, d_final):
        """(dq, dk, dv, dg, dbeta, dS_0^T) of local sequence i from the state it started from."""
        rows = self.rows(i)
        q, k, v, g, beta, do = (x[:, rows] for x in (*self.inputs, do))
        if q.shape[1] == 0:
            return *(x.new_zeros(x.shape) for x in (q, k, v, g, beta)), d_final
        if q.is_cuda:
            gradients = calls.backward(q, k, v, g.float(), beta.float(), do.contiguous(),
                                       self.start(i).float().contiguous(), d_final.float().contiguous(), checks="off",
                                       config=self._config(v))
            return tuple(gradients[:6])  # dq, dk, dv, dg, dbeta, dS_0^T (a raw gate's parameters have none here)
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta, self.start(i))]
            o, final_state = one_device.chunk_kda(*leaves[:5], scale=1.0, initial_state=leaves[5],
                                                  output_final_state=True, **self._chunk())
            return torch.autograd.grad((o, final_state), leaves, (do, d_final))

    def _chunk(self):
        """chunk_size as a keyword, if the caller chose one (else the course's KDA takes its device's default)."""
        return {} if self.chunk_size is None else {"chunk_size": self.chunk_size}

    def _config(self, v):
        return resolve_for(v.device, 1, self.H, self.d_k, v.shape[3], **self._chunk())

    def final_states(self, finals):
        """(N_seq, H, d_k, d_v): the rows of the sequences that end on this rank, zeros elsewhere."""
        states = self.inputs[0].new_zeros((self.num_sequences, self.H, self.d_k, self.d_v), dtype=self.state_dtype)
        for i, final in enumerate(finals):
            if i != self.sent:
                states[self.part.sequences[i]] = final[0]
        return states

    def initial_gradients(self, d_starts):
        """(N_seq, H, d_k, d_v): dL/dS_0^T for the sequences that begin on this rank, zeros elsewhere."""
        gradients = torch.zeros_like(self.initial_state)
        for i in self.known_start:
            gradients[self.part.sequences[i]] = d_starts[i][0]
        return gradients


# --8<-- [start:combine]
def _combine_states(context: CPContext, transition: torch.Tensor, zero_state: torch.Tensor) -> torch.Tensor:
    """Step 2 forward: the state this rank receives (zeros if it receives none), having handed on
    A S_in + Z where its last sequence goes on."""
    part = context.part
    if context.combine == "gather":  # every rank's summary to every rank; each composes the ranks before it
        transitions, zero_states = _all_gather(transition, context), _all_gather(zero_state, context)
        return pass_states(transitions, zero_states, torch.zeros_like(zero_state))[0][context.rank]
    incoming = _receive(zero_state, context, context.rank - 1) if part.receives else torch.zeros_like(zero_state)
    if part.sends:
        _, outgoing = pass_states([transition], [zero_state], incoming)  # this rank's step of the pass
        _send(outgoing, context, context.rank + 1)
    return incoming


def _combine_gradients(context: CPContext, transition: torch.Tensor, d_incoming: torch.Tensor) -> torch.Tensor:
    """Step 2 backward: the gradient of the state this rank hands on (zeros if none), having handed back
    the gradient of the state it received, A^T (that gradient) + the one through its own outputs."""
    part = context.part
    if context.combine == "gather":
        transitions, gradients = _all_gather(transition, context), _all_gather(d_incoming, context)
        return pass_state_gradients(transitions, gradients, torch.zeros_like(d_incoming))[0][context.rank]
    d_outgoing = _receive(d_incoming, context, context.rank + 1) if part.sends else torch.zeros_like(d_incoming)
    if part.receives:
        _, d_received = pass_state_gradients([transition], [d_incoming], d_outgoing)
        _send(d_received, context, context.rank - 1)
    return d_outgoing
# --8<-- [end:combine]


def _peer(context, rank):
    return rank if context.group is None else dist.get_global_rank(context.group, rank)


def _send(tensor, context, rank):
    dist.send(_on_the_wire(tensor, context), dst=_peer(context, rank), group=context.group)


def _receive(like, context, rank):
    buffer = torch.empty_like(_on_the_wire(like, context))
    dist.recv(buffer, src=_peer(context, rank), group=context.group)
    return buffer.to(like.device)


def _on_the_wire(tensor, context):
    """The tensor as the backend sends it: gloo sends CPU tensors only, so a CUDA state goes through the
    host there (one GPU shared by the ranks' processes, a test's set-up); NCCL sends it from the device."""
    if tensor.is_cuda and dist.get_backend(context.group) == "gloo":
        return tensor.cpu()
    return tensor.contiguous()


def _all_gather(tensor, context):
    wire = _on_the_wire(tensor, context)
    gathered = [torch.empty_like(wire) for _ in range(context.world_size)]
    dist.all_gather(gathered, wire, group=context.group)
    return [x.to(tensor.device) for x in gathered]


def check_cp_inputs(q, k, v, g, beta, cp_context, initial_state=None) -> None:
    """chunk_kda_cp's own checks, before any message: the context, one packed row of this rank's tokens,
    and initial_state's rows for the whole batch. Shapes past these, dtypes and values are checked by the
    course's KDA, on each sequence."""
    if not isinstance(cp_context, CPContext):
        raise TypeError(f"cp_context must be a CPContext (build_cp_context), got {type(cp_context).__name__}")
    tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != (3 if name == "beta" else 4) or x.shape[0] != 1:
            raise ValueError(f"{name} must be one packed row, (1, n, H{'' if name == 'beta' else ', D'}), of this "
                             f"rank's n tokens, got shape {tuple(x.shape)}")
    n, H = q.shape[1], q.shape[2]
    part = cp_context.part
    if n != part.tokens.stop - part.tokens.start:
        raise ValueError(f"rank {cp_context.rank} holds tokens {part.tokens.start} to {part.tokens.stop - 1} of the "
                         f"batch ({part.tokens.stop - part.tokens.start} tokens), got q with {n}")
    if any(x.shape[1:3] != (n, H) for x in tensors.values()):
        raise ValueError(f"q, k, v, g and beta must share (1, n, H) = (1, {n}, {H}), got "
                         f"{ {name: tuple(x.shape) for name, x in tensors.items()} }")
    if initial_state is not None:
        expected = (cp_context.num_sequences, H, q.shape[3], v.shape[3])
        if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != expected:
            raise ValueError(f"initial_state must be (N_seq, H, d_k, d_v) = {expected}, one S^T per sequence of the "
                             f"whole batch, got {getattr(initial_state, 'shape', type(initial_state).__name__)}")
