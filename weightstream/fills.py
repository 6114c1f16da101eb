"""Weight fills with realistic value distributions, for codec tests and benches.

Random bytes are the wrong test data for a weight codec: trained weights have
few distinct exponents. These fills give tensors whose exponent statistics
resemble real checkpoints (DESIGN.md section 8 lists the exponent entropies):

uniform
    U(-b, b) with b = `scale` (default 1 / sqrt(fan_in)), what `nn.Linear` /
    `nn.Conv` init gives (kaiming_uniform with a = sqrt(5)); fan_in = the
    product of all but the first dimension (the numel of a 1-D tensor).
gaussian
    N(0, std^2), std = `scale` (default 1 / sqrt(fan_in)).
student-t
    Student's t with `df` degrees of freedom (default 4: heavy tails like
    trained transformer weights), scaled per tensor to standard deviation
    `scale` (default 1 / sqrt(fan_in)). Sampled as z / sqrt(chi2_df / df),
    chi2_df from -2 log of uniforms (and one squared normal for odd df), so
    the result depends only on `generator`.

All fills sample in float32 on `device` and cast to `dtype` (round to nearest).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = ["FILLS", "fill", "fan_in"]

FILLS = ("uniform", "gaussian", "student-t")


def fan_in(shape: Sequence[int]) -> int:
    """Inputs per output unit: prod(shape[1:]) for >= 2-D shapes, numel for 1-D, 1 for scalars."""
    shape = tuple(shape)
    if len(shape) < 2:
        return max(1, math.prod(shape))
    return max(1, math.prod(shape[1:]))


def _check(kind, shape, df, scale) -> tuple[int, ...]:
    if kind not in FILLS:
        raise ValueError(f"kind must be one of {FILLS}, got {kind!r}")
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError:
        raise TypeError(f"shape must be a sequence of ints, got {shape!r}") from None
    if any(s < 0 for s in shape):
        raise ValueError(f"shape must have sizes >= 0, got {shape}")
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"df must be an int >= 1, got {df!r}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0 or None, got {scale!r}")
    return shape


def _chi2(shape, df: int, generator, device) -> torch.Tensor:
    out = torch.zeros(shape, dtype=torch.float32, device=device)
    for _ in range(df // 2):  # chi2 with 2 dof = -2 log U
        u = torch.rand(shape, generator=generator, device=device).clamp_(min=1e-30)
        out.sub_(u.log_().mul_(2.0))
    if df % 2:
        out.add_(torch.randn(shape, generator=generator, device=device).square_())
    return out


def fill(
    kind: str,
    shape: Sequence[int],
    *,
    dtype: torch.dtype = torch.bfloat16,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    scale: float | None = None,
    df: int = 4,
) -> torch.Tensor:
    """A new tensor of `shape` filled with `kind` (one of `FILLS`), see the module doc."""
    shape = _check(kind, shape, df, scale)
    std = scale if scale is not None else 1.0 / math.sqrt(fan_in(shape))
    if kind == "uniform":
        x = torch.rand(shape, generator=generator, device=device).mul_(2.0).sub_(1.0).mul_(std)
    elif kind == "gaussian":
        x = torch.randn(shape, generator=generator, device=device).mul_(std)
    else:
        x = torch.randn(shape, generator=generator, device=device)
        x.div_(_chi2(shape, df, generator, device).div_(df).sqrt_())
        if df > 2:  # unit variance: Var(t_df) = df / (df - 2)
            x.mul_(math.sqrt((df - 2) / df))
        x.mul_(std)
    return x.to(dtype)
