"""Pure-torch linears over a block-scaled FP8 weight: the CPU path and the Triton kernels' references.

    W[n, k] = weight[n, k] · scale_inv[n // B0, k // B1]        (float8_e4m3fn values, float32 scales per block)
    out     = x · Wᵀ                                              (fp32 accumulation, rounded to x's dtype)

With few rows (decode, a short verify: `ACTIVATION_ROWS` or fewer) x stays in its dtype (W8A16: the step is bound by
reading the weight). With more, x is quantized too, as Qwen's `activation_scheme: "dynamic"` means, in groups of B1
columns of a row (W8A8: FP8 tensor cores):

    sx[m, g] = max_{k in group g} |x[m, k]| / 448          xq[m, k] = e4m3(x[m, k] / sx[m, k // B1])
    out      = Σ_g (xq[m, g] · weight[n, g]ᵀ) · sx[m, g] · scale_inv[n // B0, g]
"""
import torch


def dequantize_weight(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [N, K] float8_e4m3fn, scale_inv [ceil(N/B0), ceil(K/B1)] float32 → W [N, K] float32."""
    num_rows, num_cols = weight.shape
    scales = scale_inv.repeat_interleave(block[0], 0)[:num_rows].repeat_interleave(block[1], 1)[:, :num_cols]
    return weight.float() * scales


ACTIVATION_ROWS = 16    # more rows than this: activations quantized too (W8A8)
E4M3_MAX = 448.0


def quantize_groups_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (xq [M, K] float8_e4m3fn, sx [M, ceil(K / group)] float32): a scale per row and group."""
    num_rows, num_cols = x.shape
    num_groups = -(-num_cols // group)
    padded = torch.zeros(num_rows, num_groups * group, dtype=torch.float32, device=x.device)
    padded[:, :num_cols] = x.float()
    groups = padded.unflatten(1, (num_groups, group))                                 # [M, G, group]
    sx = (groups.abs().amax(-1) / E4M3_MAX).clamp_min(1e-12)                          # [M, G]
    xq = (groups / sx[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return xq.flatten(1)[:, :num_cols], sx


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                   block: tuple[int, int]) -> torch.Tensor:  # x [M, K] → [M, N]
    if x.shape[0] > ACTIVATION_ROWS:
        xq, sx = quantize_groups_ref(x, block[1])
        x_real = xq.float() * sx.repeat_interleave(block[1], 1)[:, :x.shape[1]]
        return (x_real @ dequantize_weight(weight, scale_inv, block).t()).to(x.dtype)
    return (x.float() @ dequantize_weight(weight, scale_inv, block).t()).to(x.dtype)
