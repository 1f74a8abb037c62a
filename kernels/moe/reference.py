"""Pure-torch routed experts of a sparse MoE block (the CPU path and the reference of the Triton kernels).

For token t with chosen experts e_1..e_K and routing weights w_1..w_K (softmax top-k, renormalised by the caller):
    out_t = Σ_j w_j · down_e_j( silu(gate_e_j(x_t)) · up_e_j(x_t) )  [ + sigmoid(g_t) · s_t ]
where s_t is the shared expert's output and g_t its gate's logit, when the block has one (added here so that a
kernel can fuse the combine into its last pass).
Experts are stored fused: gate_up [E, 2I, H] (gate rows first), down [E, H, I]. The loop over the experts that
were chosen reads their ids on the host (`.unique().tolist()`): fine on a CPU, a host sync on a GPU — which is
why CUDA tensors take the Triton path.
"""
import torch
import torch.nn.functional as F


def moe_experts_ref(
    x: torch.Tensor,             # [T, H]
    gate_up: torch.Tensor,       # [E, 2I, H]
    down: torch.Tensor,          # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] fp32
    topk_ids: torch.Tensor,      # [T, K] int64
    shared: torch.Tensor | None = None,       # [T, H] the shared expert's output
    shared_gate: torch.Tensor | None = None,  # [T, 1] its gate's logit
) -> torch.Tensor:               # [T, H]
    weights = topk_weights.to(x.dtype)
    out = torch.zeros_like(x)
    for expert in topk_ids.unique().tolist():
        token_idx, k_idx = (topk_ids == expert).nonzero(as_tuple=True)
        gate, up = F.linear(x[token_idx], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert])                      # [n, H]
        out.index_add_(0, token_idx, y * weights[token_idx, k_idx, None])
    return out if shared is None else out + shared * torch.sigmoid(shared_gate)
