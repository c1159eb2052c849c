"""Stage: step. A stand-in for the two flash-attn 2 kernels a ring attention calls:
`_flash_attn_forward` and `_flash_attn_backward`, with flash-attn 2.8's names, signatures,
tensor layouts and return values (`flash_attn.flash_attn_interface`), computed by one of two
kernels (`use_kernel`):
- 'exact' (the default): plain torch ops, attention as the reference computes it;
- 'torch-flash': torch's own flash-attention kernels, the ones `scaled_dot_product_attention`
  dispatches to: FlashAttention-2 on a CUDA GPU where one is visible (a rank that runs on the
  CPU under gloo hands each block to it and takes the result back), else aten's CPU flash
  kernel. Both tile the keys, keep an online softmax in float32 and round the probabilities
  (and in backward dS) to the inputs' dtype before their matmuls, which 'exact' does not: a
  low-precision tolerance that only holds for textbook attention fails here.

yunchang's FA path (`AttnType.FA`, its default) reaches flash-attn through these two calls
alone: `yunchang.kernels.attention.flash_attn_forward` / `flash_attn_backward`, once per ring
step and block. flash-attn has no CPU kernels (and computes only float16 / bfloat16), so on a
CPU-only torch the case hands this module to yunchang in flash-attn's place
(`sp_harness.cases.frameworks.yunchang.shims.cpu_shims`); everything around the kernel (the ring's
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
- Not modelled (raise NotImplementedError): dropout, sliding windows, softcap, ALiBi; under
  'torch-flash' on CUDA, a causal block whose query and key lengths differ (torch's CUDA flash
  kernel takes no mask, and aligns its causal mode top-left; a zigzag or contiguous ring's
  causal blocks are square). On the CPU such a block gets flash-attn's mask explicitly.
"""

from __future__ import annotations

import math

import torch

__version__ = "2.8.3"
"""The flash-attn release whose interface this mirrors (yunchang >= 2.6.3 call path)."""


KERNELS = ("exact", "torch-flash")
"""What computes each block: see the module docstring."""

_kernel = "exact"


def use_kernel(name: str) -> None:
    """Compute every later block with kernel `name` (process-wide, as flash-attn's are)."""
    global _kernel
    if name not in KERNELS:
        raise ValueError(f"flash-attn stand-in kernel {name!r}: one of {KERNELS}")
    _kernel = name


def kernel_device() -> torch.device:
    """Where 'torch-flash' runs a block: the GPU where one is visible, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


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
    if _kernel == "torch-flash":
        out, lse = _torch_flash_forward(q, k, v, softmax_scale, causal)
        return out, lse, None, None
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
    if _kernel == "torch-flash":
        dq_, dk_, dv_ = _torch_flash_backward(dout, q, k, v, out, softmax_lse, softmax_scale, causal)
        with torch.no_grad():
            dq.copy_(dq_)
            dk.copy_(dk_)
            dv.copy_(dv_)
        return (dout.to(ct) * out.to(ct)).sum(-1).transpose(1, 2).float()  # (B, Hq, Sq)
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


def _heads_first(t: torch.Tensor, group: int, device: torch.device) -> torch.Tensor:
    """(B, S, H, D) -> (B, H * group, S, D) on `device`: torch's kernels take heads first, and
    equal query and k/v head counts (each k/v head repeated for the query heads it serves)."""
    t = t.transpose(1, 2)
    return (t.repeat_interleave(group, dim=1) if group > 1 else t).to(device)


def _bottom_right(sq: int, sk: int, dtype: torch.dtype, device: torch.device, causal: bool):
    """(is_causal, additive mask or None, bool per query row that sees no key or None) for torch's
    kernels: a square causal block is their own causal mode; a causal block of unequal lengths
    gets flash-attn's bottom-right mask as an explicit mask (the CPU kernel takes one; torch
    aligns its causal mode top-left there, and its CUDA flash kernel takes no mask)."""
    if not causal or sq == sk:
        return causal, None, None
    if device.type == "cuda":
        raise NotImplementedError(f"flash-attn stand-in (torch-flash on CUDA): a causal block of {sq} queries x {sk} "
                                  "keys (torch's CUDA flash kernel takes no bottom-right mask)")
    keep = torch.arange(sk, device=device)[None] <= torch.arange(sq, device=device)[:, None] + (sk - sq)
    mask = torch.zeros(sq, sk, dtype=dtype, device=device).masked_fill(~keep, float("-inf"))
    return False, mask, ~keep.any(-1)


def _torch_flash_forward(q, k, v, softmax_scale, causal):
    """One block by torch's flash kernel -> out (B, Sq, Hq, D) in q's dtype, lse (B, Hq, Sq); a
    row that sees no key gets flash-attn's output 0 and LSE +inf."""
    sq, sk = q.shape[1], k.shape[1]
    group = q.shape[2] // k.shape[2]
    dev = kernel_device()
    qh, kh, vh = _heads_first(q, 1, dev), _heads_first(k, group, dev), _heads_first(v, group, dev)
    is_causal, mask, empty = _bottom_right(sq, sk, q.dtype, dev, causal)
    if dev.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, is_causal, False,
                                                                      scale=softmax_scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qh, kh, vh, 0.0, is_causal,
                                                                              attn_mask=mask, scale=softmax_scale)
    if empty is not None and bool(empty.any()):
        out = out.masked_fill(empty[:, None], 0)
        lse = lse.masked_fill(empty, float("inf"))
    ct = _compute_dtype(q.dtype)
    return out.transpose(1, 2).to(q.device), lse.to(device=q.device, dtype=ct).contiguous()


def _torch_flash_backward(dout, q, k, v, out, softmax_lse, softmax_scale, causal):
    """One block's (dq, dk, dv) by torch's flash backward kernel, from the GIVEN out and lse (a
    ring's merged ones), in q's, k's and v's layout; dk, dv summed over each k/v head's queries."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group = hq // hk
    dev = kernel_device()
    qh, kh, vh = _heads_first(q, 1, dev), _heads_first(k, group, dev), _heads_first(v, group, dev)
    doh, oh = _heads_first(dout, 1, dev), _heads_first(out, 1, dev)
    lse = softmax_lse.to(device=dev, dtype=torch.float32 if dev.type == "cuda" else softmax_lse.dtype)
    is_causal, mask, _ = _bottom_right(sq, sk, q.dtype, dev, causal)
    if dev.type == "cuda":
        # the dense kernel's bookkeeping outputs (sequence offsets, RNG state), from a forward of
        # this block: the backward takes them, though without dropout or packing it ignores them
        _, _, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            qh, kh, vh, 0.0, is_causal, False, scale=softmax_scale)
        dqh, dkh, dvh = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            doh, qh, kh, vh, oh, lse, cum_q, cum_k, max_q, max_k, 0.0, is_causal, seed, offset, scale=softmax_scale)
    else:
        dqh, dkh, dvh = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            doh, qh, kh, vh, oh, lse, 0.0, is_causal, attn_mask=mask, scale=softmax_scale)
    if group > 1:  # summed in float32, as flash-attn accumulates a grouped head's dk, dv
        acc = torch.promote_types(dkh.dtype, torch.float32)
        dkh = dkh.to(acc).view(b, hk, group, sk, d).sum(2).to(k.dtype)  # (B, Hk, Sk, D)
        dvh = dvh.to(acc).view(b, hk, group, sk, d).sum(2).to(v.dtype)
    return (dqh.transpose(1, 2).to(q.device), dkh.transpose(1, 2).to(k.device), dvh.transpose(1, 2).to(v.device))


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


__all__ = ["KERNELS", "__version__", "_flash_attn_forward", "_flash_attn_backward", "flash_attn_func", "kernel_device",
           "use_kernel"]
