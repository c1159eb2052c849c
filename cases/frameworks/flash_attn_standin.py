"""Stage: build sharded. An exact CPU stand-in for the two flash-attn 2 kernels a ring attention
calls: `_flash_attn_forward` and `_flash_attn_backward`, with flash-attn 2.8's names, signatures,
tensor layouts and return values (`flash_attn.flash_attn_interface`), computed by plain torch.

yunchang's FA path (`AttnType.FA`, its default) reaches flash-attn through these two calls
alone: `yunchang.kernels.attention.flash_attn_forward` / `flash_attn_backward`, once per ring
step and block. flash-attn has no CPU kernels (and computes only float16 / bfloat16), so on a
CPU-only torch the case hands this module to yunchang in flash-attn's place
(`sp_harness.cases.frameworks.yunchang.cpu_shims`); everything around the kernel (the ring's
p2p loop, its LSE merge `update_out_and_lse`, its buffers and casts, the Ulysses all-to-alls) is
yunchang's own code.

What flash-attn computes, and so what this does:
- q (B, Sq, Hq, D), k and v (B, Sk, Hk, D), Hk dividing Hq (grouped-query: query head i uses
  k/v head i // (Hq / Hk)); scores scaled by `softmax_scale`.
- `causal`: the mask is aligned to the bottom right (flash-attn >= 2.1): query i sees key j iff
  j <= i + Sk - Sq. A query row that sees no key has output 0 and LSE +inf.
- forward returns (out, softmax_lse, S_dmask, rng_state): out (B, Sq, Hq, D) in q's dtype,
  softmax_lse (B, Hq, Sq) the natural-log log-sum-exp of each row's scaled scores.
- backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, ...) recomputes the probabilities from
  the GIVEN `softmax_lse` (a ring passes the merged, global one) as P = exp(S - lse), takes
  D = rowsum(dout * out) from the GIVEN `out`, and writes dq, dk, dv in place (dk, dv summed
  over each k/v head's query heads); it returns softmax_d (D, (B, Hq, Sq), float32).
- Precision: flash-attn takes float16 / bfloat16 and accumulates in float32, with a float32
  LSE; so does this for those dtypes. float32 and float64, which flash-attn does not take,
  are computed in their own dtype (the LSE too): exact attention, no island of the stand-in's.
- Not modelled (raise NotImplementedError): dropout, sliding windows, softcap, ALiBi.
"""

from __future__ import annotations

import math

import torch

__version__ = "2.8.3"
"""The flash-attn release whose interface this mirrors (yunchang >= 2.6.3 call path)."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _unsupported(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes) -> None:
    if dropout_p:
        raise NotImplementedError(f"flash-attn stand-in: dropout_p={dropout_p} (only 0)")
    if (window_size_left, window_size_right) not in ((-1, -1), (None, None)):
        raise NotImplementedError(f"flash-attn stand-in: window ({window_size_left}, {window_size_right})")
    if softcap:
        raise NotImplementedError(f"flash-attn stand-in: softcap={softcap}")
    if alibi_slopes is not None:
        raise NotImplementedError("flash-attn stand-in: alibi_slopes")


def _scores(q: torch.Tensor, k: torch.Tensor, softmax_scale: float, causal: bool):
    """(B, Hq, Sq, Sk) scaled scores in the compute dtype, -inf where masked, and the keep mask."""
    ct = _compute_dtype(q.dtype)
    group = q.shape[2] // k.shape[2]
    qh = q.to(ct).transpose(1, 2)  # (B, Hq, Sq, D)
    kh = k.to(ct).transpose(1, 2).repeat_interleave(group, dim=1)  # (B, Hq, Sk, D)
    s = (qh @ kh.transpose(-2, -1)) * softmax_scale
    keep = None
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        rows = torch.arange(sq, device=q.device).unsqueeze(1)
        cols = torch.arange(sk, device=q.device).unsqueeze(0)
        keep = cols <= rows + (sk - sq)  # bottom-right aligned, as flash-attn >= 2.1
        s = s.masked_fill(~keep, float("-inf"))
    return s, keep


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1, window_size_right=-1,
                        softcap=0.0, alibi_slopes=None, return_softmax=False):
    """flash-attn 2.8's `_flash_attn_forward`: -> (out, softmax_lse, S_dmask, rng_state)."""
    _unsupported(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    if q.shape[2] % k.shape[2]:
        raise RuntimeError(f"Number of heads in key/value ({k.shape[2]}) must divide the query's ({q.shape[2]})")
    ct = _compute_dtype(q.dtype)
    s, _ = _scores(q, k, softmax_scale, causal)  # (B, Hq, Sq, Sk)
    lse = torch.logsumexp(s, dim=-1)  # (B, Hq, Sq); -inf for a row that sees nothing
    empty = torch.isneginf(lse)
    p = torch.exp(s - lse.masked_fill(empty, 0).unsqueeze(-1))  # exactly 0 where masked
    group = q.shape[2] // k.shape[2]
    vh = v.to(ct).transpose(1, 2).repeat_interleave(group, dim=1)  # (B, Hq, Sk, D)
    out = (p @ vh).transpose(1, 2).to(q.dtype)  # (B, Sq, Hq, D)
    lse = lse.masked_fill(empty, float("inf"))  # flash-attn's value for a row with no key
    return out, lse.to(ct).contiguous(), None, None


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                         deterministic=False, rng_state=None):
    """flash-attn 2.8's `_flash_attn_backward`: writes dq, dk, dv in place; -> softmax_d."""
    _unsupported(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    ct = _compute_dtype(q.dtype)
    b, sq, hq, d = q.shape
    hk = k.shape[2]
    group = hq // hk
    s, keep = _scores(q, k, softmax_scale, causal)  # (B, Hq, Sq, Sk)
    lse = softmax_lse.to(ct)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0).unsqueeze(-1))  # from the GIVEN lse
    if keep is not None:
        p = p.masked_fill(~keep, 0)
    p = p.masked_fill(torch.isinf(lse).unsqueeze(-1), 0)
    do = dout.to(ct).transpose(1, 2)  # (B, Hq, Sq, D)
    o = out.to(ct).transpose(1, 2)
    vh = v.to(ct).transpose(1, 2).repeat_interleave(group, dim=1)  # (B, Hq, Sk, D)
    kh = k.to(ct).transpose(1, 2).repeat_interleave(group, dim=1)
    qh = q.to(ct).transpose(1, 2)
    delta = (do * o).sum(-1)  # (B, Hq, Sq): D = rowsum(dout * out), from the GIVEN out
    dp = do @ vh.transpose(-2, -1)  # (B, Hq, Sq, Sk)
    ds = p * (dp - delta.unsqueeze(-1))
    dq_ = (ds @ kh) * softmax_scale  # (B, Hq, Sq, D)
    dk_ = (ds.transpose(-2, -1) @ qh) * softmax_scale  # (B, Hq, Sk, D)
    dv_ = p.transpose(-2, -1) @ do  # (B, Hq, Sk, D)
    sk = k.shape[1]
    dk_ = dk_.view(b, hk, group, sk, d).sum(2)  # (B, Hk, Sk, D): over each k/v head's query heads
    dv_ = dv_.view(b, hk, group, sk, d).sum(2)
    with torch.no_grad():
        dq.copy_(dq_.transpose(1, 2))
        dk.copy_(dk_.transpose(1, 2))
        dv.copy_(dv_.transpose(1, 2))
    return delta.float()


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn's public `flash_attn_func` (forward and backward by the two kernels above)."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = _FlashAttnFunc.apply(q, k, v, softmax_scale, causal,
                                    (dropout_p, window_size[0], window_size[1], softcap, alibi_slopes))
    return (out, lse, None) if return_attn_probs else out


class _FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, rest):
        dropout_p, left, right, softcap, alibi = rest
        out, lse, _, _ = _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, left, right, softcap, alibi)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.softmax_scale, ctx.causal, ctx.rest = softmax_scale, causal, rest
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dropout_p, left, right, softcap, alibi = ctx.rest
        _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, dropout_p, ctx.softmax_scale, ctx.causal,
                             left, right, softcap, alibi, False)
        return dq, dk, dv, None, None, None


__all__ = ["__version__", "_flash_attn_forward", "_flash_attn_backward", "flash_attn_func"]
