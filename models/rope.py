"""Rotary position embedding (RoPE) as every family's attention applies it: q and k together, in few kernels.

Generic on purpose, like models/attention.py: the families differ in their frequencies (theta, Llama 3.1's
scaling), which each builds into a table with `rope_table`, not in how a head is rotated.

Hugging Face checkpoints pair a head's element i with element i + head_dim/2 ("rotate half"), and this
recipe keeps their `wq`/`wk` rows as they are. Written out, rotate-half costs a roll, two multiplies and an
add each way. Here each pair is gathered next to its partner once (one copy, in float32) and rotated by one
complex multiply; the result stays in that interleaved order. q and k leave RoPE permuted alike within
each head, and attention only takes dot products of q with k, so its output does not change (the
permutation cancels in q . k; v is not permuted). q and k are rotated together: the copy that gathers the
pairs puts q's heads and k's side by side, so one copy and one multiply serve both. Backward mirrors it: one
complex multiply by the conjugate angles, then one copy each back to the rotate-half order of the
projections' rows.

Kernels for q and k, forward + backward, in eager mode (the kernel counts of docs/benchmarks.md): float32
3 + 4, bfloat16 5 + 5 (the casts to float32 and back), against 8 + 8 and 12 + 14 written out, and torchtitan's
complex form on its interleaved rows: 2 + 4 and 6 + 8. q and k come out in storages of their own (a multiply,
or a cast, each), so that a k attention does not keep is freed. Under torch.compile each is written in real arithmetic,
which inductor fuses into one kernel each way (tests/test_model.py).
"""

from __future__ import annotations

import torch


def rope_table(inv_freq: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """(2, max_seq_len, head_dim // 2, 2) float32: [0] (cos, sin) of each pair's angle at each position, the
    forward's rotation; [1] (cos, -sin), its inverse, for backward. `inv_freq`: (head_dim // 2,) float32."""
    positions = torch.arange(max_seq_len, device=inv_freq.device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # (max_seq_len, head_dim // 2)
    cos, sin = angles.cos(), angles.sin()
    return torch.stack([torch.stack([cos, sin], dim=-1), torch.stack([cos, -sin], dim=-1)])


def apply_rope(q: torch.Tensor, k: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (bs, seqlen, heads, head_dim) and k (bs, seqlen, kv_heads, head_dim), rotate-half order, rotated by the
    angles of `table[:, :seqlen]` (rope_table's, or its rows at given positions). Returned in the interleaved order
    (x0, x_{h}), (x1, x_{h+1}), ... of each head, both alike (module docstring): q and k together, because only
    their dot products are the same as rotate-half's. In eager mode both are rotated at once: one copy gathers the
    pairs of both, and q and k come back in storages of their own (_Rotate)."""
    table = table[:, : q.shape[1], None]  # (2, seqlen, 1, head_dim // 2, 2): broadcast over bs and heads
    if torch.compiler.is_compiling():
        return _rotate_fused(q, table[0]), _rotate_fused(k, table[0])
    return _Rotate.apply(q, k, table)


def _rotate_fused(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """What _Rotate computes, in real arithmetic for torch.compile: inductor fuses it into one kernel each way,
    casts included, where it would split the complex form around the casts (two kernels each way in bfloat16)."""
    first, second = x.to(_working_dtype(x.dtype)).view(*x.shape[:-1], 2, -1).unbind(-2)  # pair halves
    cos, sin = angles.float().unbind(-1)
    return torch.stack([first * cos - second * sin, first * sin + second * cos], dim=-1).flatten(-2).to(x.dtype)


def _working_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 tensors (a Python choice: torch.promote_types would be an op in backward)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _working(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype` and contiguous: one copy (a cast when the dtype differs)."""
    return t.contiguous() if t.dtype == dtype else t.to(dtype, memory_format=torch.contiguous_format)


def _pairs(x: torch.Tensor) -> torch.Tensor:
    """x (..., head_dim) in rotate-half order as (..., head_dim // 2, 2) pairs (x_i, x_{i + head_dim/2}): a view."""
    return x.view(*x.shape[:-1], 2, -1).transpose(-1, -2)


class _Rotate(torch.autograd.Function):
    """The eager rotation of q and k (module docstring): autograd's own backward of it would take more kernels."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, q: torch.Tensor, k: torch.Tensor, table: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        table = table.float()  # float32 already, unless a module.to(dtype) cast the buffer
        ctx.save_for_backward(table[1])
        ctx.q_heads = q.shape[2]
        work = _working_dtype(q.dtype)
        # The pairs of q's and k's heads side by side: one copy (and a cast in bfloat16).
        pairs = torch.view_as_complex(torch.cat([_pairs(q), _pairs(k)], dim=2).to(work))
        angles = torch.view_as_complex(table[0])
        # q and k come back in storages of their own: attention keeps q for backward, and a k sharing q's storage
        # would stay alive with it where attention keeps only k's repeated or gathered copy (grouped-query
        # attention, context parallel). In float32 one multiply each; in bfloat16 one multiply, then a cast each.
        if q.dtype == work:
            q_pairs, k_pairs = pairs[:, :, : ctx.q_heads], pairs[:, :, ctx.q_heads :]
            return torch.view_as_real(q_pairs * angles).flatten(-2), torch.view_as_real(k_pairs * angles).flatten(-2)
        rotated = torch.view_as_real(pairs * angles).flatten(-2)
        return rotated[:, :, : ctx.q_heads].to(q.dtype), rotated[:, :, ctx.q_heads :].to(q.dtype)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_q: torch.Tensor, grad_k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        (inverse,) = ctx.saved_tensors
        dtype = grad_q.dtype
        grad = torch.cat([grad_q, grad_k], dim=2).to(_working_dtype(dtype))  # one copy (and a cast in bfloat16)
        g = torch.view_as_complex(grad.view(*grad.shape[:-1], -1, 2)) * torch.view_as_complex(inverse)
        g = torch.view_as_real(g)
        # Back to each projection's rotate-half order, contiguous: one copy each (the cast with it).
        return (
            _working(g[:, :, : ctx.q_heads].transpose(-1, -2), dtype).flatten(-2),
            _working(g[:, :, ctx.q_heads :].transpose(-1, -2), dtype).flatten(-2),
            None,
        )
