"""Error bounds of float32 arithmetic, for tests that compare against float64.

Each bound follows the standard model fl(a op b) = (a op b)(1 + d), |d| <= u (Higham,
"Accuracy and Stability of Numerical Algorithms", ch. 2-3): n roundings in a row give a
relative error of at most gamma_n = n u / (1 - n u), and a sum of n terms in any order is
within gamma_(n-1) * sum |terms| of the exact sum.
"""

from __future__ import annotations

import torch

U = 2.0**-24  # float32 unit roundoff


def gamma(n: int) -> float:
    """gamma_n = n u / (1 - n u)."""
    return n * U / (1 - n * U)


def fma_chain_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Error bound of y = sum_k w[m, k] x[r, k] summed by K fused multiply-adds in turn
    (gemm.c): each step rounds once, so |y - exact| <= gamma_K * sum_k |w x|. W and x are
    exact float32 inputs; the float64 reference adds its own K * 2^-53 relative."""
    k = x.shape[1]
    return (gamma(k) + k * 2.0**-53) * (x.double().abs() @ w.double().abs().t())


def attention_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    visible: torch.Tensor, dot_roundings: int) -> torch.Tensor:
    """Bound on |out - exact| of float32 softmax attention. q: [T, H, D]; k, v: [S, KVH, D];
    visible: [T, S] bool -> [T, H, D].

    Scores s = (q * scale) . k carry |ds| <= gamma(dot_roundings) * scale * sum |q k| (the
    scaling and the D-term sum: D + 1 roundings in any order, fewer for a lane-parallel sum).
    exp(s - m) then has a relative error <= 2 max|ds| + 8u (both arguments, the subtraction,
    an exp within ~1 ulp, with margin). The numerator sums S products (gamma(2S) relative to
    sum e |v|), the denominator S terms (gamma(S)), one division:
    |dout| <= (2 (2 max|ds| + 8u) + gamma(2S) + gamma(S) + u) * sum p |v|."""
    heads, s = q.shape[1], k.shape[0]
    kv = torch.arange(heads) // (heads // k.shape[1])
    kq, vq = k.double()[:, kv], v.double()[:, kv]  # [S, H, D]
    qd = q.double()
    mag = scale * torch.einsum("thd,shd->ths", qd.abs(), kq.abs())
    ds = gamma(dot_roundings) * mag.masked_fill(~visible[:, None], 0).amax(-1)  # [T, H]
    scores = (scale * torch.einsum("thd,shd->ths", qd, kq)).masked_fill(~visible[:, None],
                                                                        float("-inf"))
    p = torch.softmax(scores, -1)
    mass = torch.einsum("ths,shd->thd", p, vq.abs())
    rel = 2 * (2 * ds + 8 * U) + gamma(2 * s) + gamma(s) + U
    return rel[..., None] * mass
