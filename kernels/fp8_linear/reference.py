"""Pure-torch linear over a block-scaled FP8 weight: the CPU path and the Triton kernels' reference.

    W[n, k] = weight[n, k] · scale_inv[n // B0, k // B1]        (float8_e4m3fn values, float32 scales per block)
    out     = x · Wᵀ                                              (fp32 accumulation, rounded to x's dtype)

Weight-only FP8: the activations stay in their dtype. The result is then a continuous function of x, as a bf16
linear's is, so the small differences between a step of one row and a verify step of k + 1 rows (other kernels,
other summation orders) stay small, and speculation gives plain decoding's tokens as it does in bf16. Quantizing the
activations too (Qwen's `activation_scheme: "dynamic"`, FP8 tensor cores) rounds each to 1/16 of its group's
largest: a tiny difference that crosses a rounding boundary becomes a large one (bench/README.md, "FP8 linears").
"""
import torch


def dequantize_weight(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [N, K] float8_e4m3fn, scale_inv [ceil(N/B0), ceil(K/B1)] float32 → W [N, K] float32."""
    num_rows, num_cols = weight.shape
    scales = scale_inv.repeat_interleave(block[0], 0)[:num_rows].repeat_interleave(block[1], 1)[:, :num_cols]
    return weight.float() * scales


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                   block: tuple[int, int]) -> torch.Tensor:  # x [M, K] → [M, N]
    return (x.float() @ dequantize_weight(weight, scale_inv, block).t()).to(x.dtype)
