"""How a model hands its tensors to KDA, and what the kernels compute from them as they load them.

A model does not compute KDA's gate, norms and beta in front of the kernels: Kimi Linear's layer
(FLA's `KimiDeltaAttention`) passes the raw gate projection x with `A_log` (HV,) and `dt_bias`
(HV * K), and raw q, k and beta logits, and asks for the rest inside (FLA's `use_gate_in_kernel`,
`use_qk_l2norm_in_kernel`, `use_beta_sigmoid_in_kernel`). An `InputForm` says which of these the
caller's tensors need; `activate` is their one definition, in torch, which the CPU references and the
tests use and the kernels' loads compute (stages.kda.tiles.activated_loads):

    gate "log"       g is log a itself (<= 0), as stages 4-7 take it
         "softplus"  g = -exp(A_log) * softplus(x + dt_bias)                   (any finite g <= 0)
         "sigmoid"   g = lower_bound * sigmoid(exp(A_log) * (x + dt_bias))     (in [lower_bound, 0])
                     or lower_bound * sigmoid(x + dt_bias) without A_log
    q, k             divided by sqrt(||x||^2 + 1e-6) over K (l2_normalize), then q times `scale`
    beta "value"     beta itself, in [0, 1]
         "sigmoid"   sigmoid(beta)                                             (in (0, 1))
         "sigmoid2"  2 sigmoid(beta), FLA's allow_neg_eigval                   (in (0, 2))

dt_bias is optional in both gate forms (None: no bias). softplus(x) is log(1 + e^x), taken as x itself
above 20 (FLA's threshold: there the two agree to float32's precision).
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

GATE_FORMS = ("log", "softplus", "sigmoid")
BETA_FORMS = ("value", "sigmoid", "sigmoid2")
L2_NORM_EPS = 1e-6  # FLA's l2norm: x / sqrt(sum x^2 + eps)
SOFTPLUS_THRESHOLD = 20.0  # softplus(x) = x above it (torch's and FLA's default)


@dataclass(frozen=True)
class InputForm:
    """Which transforms the kernels apply to q, k, g and beta as they load them (see the module's
    docstring); the default is none: the tensors are the recurrence's own, as stages 4-7 take them."""

    gate: str = "log"
    lower_bound: float | None = None  # the "sigmoid" gate's floor, < 0
    l2_normalize: bool = False
    beta: str = "value"
    scale: float = 1.0  # q's factor after the norm: o = S (scale q)

    def __post_init__(self):
        if self.gate not in GATE_FORMS:
            raise ValueError(f"gate must be one of {', '.join(map(repr, GATE_FORMS))}, got {self.gate!r}")
        if self.beta not in BETA_FORMS:
            raise ValueError(f"beta must be one of {', '.join(map(repr, BETA_FORMS))}, got {self.beta!r}")
        if (self.gate == "sigmoid") != (self.lower_bound is not None):
            raise ValueError("lower_bound is the 'sigmoid' gate's floor: give it with that gate and with no other, "
                             f"got gate={self.gate!r}, lower_bound={self.lower_bound!r}")
        if self.lower_bound is not None and not self.lower_bound < 0:
            raise ValueError(f"lower_bound must be below 0 (a log gate), got {self.lower_bound}")

    @property
    def raw_gate(self) -> bool:
        """Whether g is the raw projection x, activated inside (FLA's use_gate_in_kernel)."""
        return self.gate != "log"

    @property
    def beta_bound(self) -> float:
        """The largest beta the kernels can see: 2 with "sigmoid2", else 1."""
        return 2.0 if self.beta == "sigmoid2" else 1.0

    @property
    def is_plain(self) -> bool:
        """Nothing to compute on load: the kernels read q, k, g and beta as they are."""
        return self == InputForm()


def activate(form: InputForm, q: "torch.Tensor", k: "torch.Tensor", g: "torch.Tensor", beta: "torch.Tensor",
             A_log: "torch.Tensor | None" = None, dt_bias: "torch.Tensor | None" = None
             ) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]":
    """(q, k, g, beta) as the recurrence takes them, from the caller's tensors in `form`, in float32
    (float64 stays float64): q, k (..., H, K), g (..., HV, K), beta (..., HV); A_log (HV,), dt_bias
    (HV * K,) or (HV, K). Differentiable: autograd takes the gradients of the raw tensors through it."""
    import torch

    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, g, beta = q.to(wide), k.to(wide), g.to(wide), beta.to(wide)
    if form.l2_normalize:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_NORM_EPS)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_NORM_EPS)
    q = q * form.scale
    if form.raw_gate:
        g = activate_gate(form, g, A_log, dt_bias)
    if form.beta != "value":
        beta = form.beta_bound * torch.sigmoid(beta)
    return q, k, g, beta


def activate_gate(form: InputForm, x: "torch.Tensor", A_log: "torch.Tensor | None",
                  dt_bias: "torch.Tensor | None") -> "torch.Tensor":
    """The log gate g (..., HV, K) from the raw projection x in form's gate ("softplus" or "sigmoid"),
    in x's dtype (float32 or float64)."""
    import torch

    HV, K = x.shape[-2:]
    if dt_bias is not None:
        x = x + dt_bias.to(x.dtype).view(HV, K)
    if form.gate == "softplus":
        if A_log is None:
            raise ValueError("the 'softplus' gate needs A_log: g = -exp(A_log) * softplus(x + dt_bias)")
        rate = torch.exp(A_log.to(x.dtype)).view(HV, 1)
        return -rate * torch.nn.functional.softplus(x, threshold=SOFTPLUS_THRESHOLD)
    if A_log is not None:
        x = torch.exp(A_log.to(x.dtype)).view(HV, 1) * x
    return form.lower_bound * torch.sigmoid(x)
