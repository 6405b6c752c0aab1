"""Exact mode's kernels in Triton (CUDA; docs/exact.md, "On CUDA"): the contracts of `agents.exact.linear`,
`attention`, `last_sum` and `softmax_stats`, one launch each instead of many.

Why kernels of our own: cuBLAS picks its algorithm, tile and split-K from the problem's shape, and SDPA / flash
attention pick their split of the key axis from the batch and the lengths, so a row's bits depend on how many rows
share its call. Batch invariance needs one configuration, fixed in the code, whatever the shapes of the call.

* `matmul` (`agents.triton_matmul`): K walked from 0 in fixed steps into float32 in every tile, no split-K, and a
  tile other than the reference serves only where it gives the reference's bits on this device.
* `attention`: the key axis cut into blocks of `KEY_BLOCK` positions from position 0, visited in order (online
  softmax, float32); a program holds `QUERY_BLOCK` (query, head) rows, each row's arithmetic its own. A block past a
  row's position is an exact no-op for it (p = 0, the max stays, the rescale is exp(0) = 1), so which queries share a
  program (decode's one, a prefill after a cached prefix, the trainer's whole sequence) and trailing keys change no
  bit. It also writes each row's log-sum-exp: `sequence_attention` (the trainer's) differentiates by flash
  attention's backward from this forward's output and log-sum-exp (gradients are not compared bit for bit).
* `row_sum`, `softmax_stats`: one program per row, `SUM_BLOCK` lanes each adding the row's elements at its lane in
  order, then one fixed tree over the lanes: an order set by the row's length alone.

Under Triton's interpreter (``TRITON_INTERPRET=1``, CPU, float32) a loop bound must be a constant: there the loops run
over the whole axis with the same masks — the same arithmetic, by the no-op argument above.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .triton_matmul import REFERENCE, cdiv, inline, kernel, next_power_of_2
from .triton_matmul import forward_bits_in_recompute, matmul, use_scratch  # noqa: F401  (`agents.exact` calls them)

#: key positions per block of `attention`'s online softmax (the fixed split of the key axis)
KEY_BLOCK = 64
#: (query, head) rows per attention program
QUERY_BLOCK = 64
#: lanes of `row_sum` (a shorter row: the next power of two of its length)
SUM_BLOCK = 1024
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = tuple(REFERENCE)  #: the input dtypes of the kernels
#: True: `sequence_attention` differentiates by flash attention's backward where flash runs and passed its check on
#: that device (`flash_backward_agrees`), else by recomputing with SDPA. ``MT_ENV_EXACT_FLASH_BACKWARD=0`` turns it off.
FLASH_BACKWARD = os.environ.get("MT_ENV_EXACT_FLASH_BACKWARD", "1") != "0"


@triton.jit(do_not_specialize=["queries", "keys", "stride_ps", "stride_is", "stride_ls", "stride_lh"])
def _attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, len_ptr, idx_ptr, out_ptr, lse_ptr, queries, keys, scale,
                      stride_qs, stride_qh, stride_qt, stride_ks, stride_kh, stride_kt, stride_vs, stride_vh, stride_vt,
                      stride_os, stride_oh, stride_ot, stride_ps, stride_is, stride_ls, stride_lh,
                      GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, IEEE: tl.constexpr, INDEXED: tl.constexpr, FLAT_QUERIES: tl.constexpr,
                      STATIC_KEYS: tl.constexpr, INTERPRETED: tl.constexpr):
    tile, s, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # row r: query r // GROUP, head r % GROUP of the KV head's group
    t, head = r // GROUP, kv_head * GROUP + r % GROUP
    real = t < queries
    dims = tl.arange(0, BLOCK_D)
    in_dim = dims < DIM
    length = tl.minimum(tl.load(len_ptr + s), keys)
    if FLAT_QUERIES:  # the trainer's flat rows: query t of sequence s is row idx[s, t], at position t, its output there
        real = real & (t < length)
        pos = tl.where(real, t, -1)
        q_row = tl.load(idx_ptr + s * stride_is + t, mask=real, other=0).to(tl.int64)
        q_at, o_at, l_at = q_row * stride_qt, q_row * stride_ot, q_row
    else:
        pos = tl.load(pos_ptr + s * stride_ps + t, mask=real, other=-1)
        q_at, o_at, l_at = s * stride_qs + t * stride_qt, s * stride_os + t * stride_ot, s * stride_ls + t
    q = tl.load(q_ptr + q_at[:, None] + head[:, None] * stride_qh + dims[None, :],
                mask=real[:, None] & in_dim[None, :], other=0.0)
    best = tl.full([BLOCK_M], -3.4028234663852886e38, tl.float32)  # finite: a block seen by no row changes nothing
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = tl.minimum(tl.max(pos) + 1, length)
    k_base = k_ptr + s * stride_ks + kv_head * stride_kh
    v_base = v_ptr + s * stride_vs + kv_head * stride_vh
    for start in range(0, STATIC_KEYS if INTERPRETED else end, BLOCK_N):  # key blocks from position 0, in order
        key = start + tl.arange(0, BLOCK_N)
        inside = key < length
        if INDEXED:  # flat K/V rows: the key at position t of sequence s is row idx[s, t] (a paged cache's)
            row = tl.load(idx_ptr + s * stride_is + key, mask=inside, other=0).to(tl.int64)
        else:
            row = key
        k = tl.load(k_base + row[:, None] * stride_kt + dims[None, :], mask=inside[:, None] & in_dim[None, :],
                    other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where((key[None, :] <= pos[:, None]) & inside[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, 1))
        p = tl.exp(scores - new_best[:, None])
        alpha = tl.exp(best - new_best)
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(v_base + row[:, None] * stride_vt + dims[None, :], mask=inside[:, None] & in_dim[None, :],
                    other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        best = new_best
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + o_at[:, None] + head[:, None] * stride_oh + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=real[:, None] & in_dim[None, :])
    # the log-sum-exp of the row's scaled scores (flash attention's, for its backward); +inf where it sees no key
    seen = total > 0
    tl.store(lse_ptr + l_at + head * stride_lh, tl.where(seen, best + tl.log(tl.where(seen, total, 1.0)), float("inf")),
             mask=real)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_len: torch.Tensor,
              scale: float, k_index: torch.Tensor | None = None) -> torch.Tensor:
    """`agents.exact.attention`'s contract: queries `q` [S, heads, Tq, d] at positions `q_pos` [S, Tq] over keys and
    values `k`, `v` [S, kv_heads, Tk, d] indexed by position, the first `k_len` [S] valid; float32 [S, heads, Tq, d]
    (0 for a query that sees no key). With `k_index` [S, Tk], `k` and `v` are flat rows [P, kv_heads, d] and position
    t of sequence s is row ``k_index[s, t]`` (a paged cache read in place): the same bits as the gathered keys.
    `k` and `v` are read in q's dtype (bfloat16, float16 or float32). Differentiable: the backward recomputes the
    attention with SDPA under the same mask (gradients are not compared bit for bit)."""
    return torch.ops.mt_env.exact_attention(q, k, v, q_pos, k_len, scale, k_index)


@torch.library.custom_op("mt_env::exact_attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_len: torch.Tensor,
                  scale: float, k_index: Optional[torch.Tensor]) -> torch.Tensor:
    return _attention(q, k, v, q_pos, k_len, scale, k_index)[0]


@_attention_op.register_fake
def _(q, k, v, q_pos, k_len, scale, k_index):
    _check_attention(q.shape, q.dtype, k, v, k_index)
    return q.new_empty(q.shape, dtype=torch.float32)


def _attention_setup(ctx, inputs, output):
    q, k, v, q_pos, k_len, scale, k_index = inputs
    ctx.save_for_backward(q, k, v, q_pos, k_len, k_index)
    ctx.scale = scale


def _attention_backward(ctx, grad):
    q, k, v, q_pos, k_len, k_index = ctx.saved_tensors
    inputs = [t.detach().requires_grad_(need) for t, need in zip((q, k, v), ctx.needs_input_grad[:3])]
    with torch.enable_grad():
        keys, values = inputs[1:]
        if k_index is not None:  # the gather's backward scatters the keys' gradients back to their rows
            keys, values = keys[k_index].transpose(1, 2), values[k_index].transpose(1, 2)
        out = _reference(inputs[0], keys, values, q_pos, k_len, ctx.scale)
    wanted = [t for t in inputs if t.requires_grad]
    grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
    return (*(next(grads) if t.requires_grad else None for t in inputs), None, None, None, None)


_attention_op.register_autograd(_attention_backward, setup_context=_attention_setup)
inline(_attention_op, lambda *args, traced: _attention(*args, traced=traced)[0])


def _check_attention(q_shape: tuple, dtype: torch.dtype, k: torch.Tensor, v: torch.Tensor,
                     k_index: torch.Tensor | None) -> None:
    """ValueError unless queries of `q_shape` [S, heads, Tq, d] and `dtype` fit keys and values `k`, `v`."""
    S, heads, Tq, d = q_shape
    flat = k_index is not None  # [rows, kv_heads, d] rather than [S, kv_heads, Tk, d]: kv_heads is dim 1 of both
    if k.dim() != (3 if flat else 4) or k.shape != v.shape or k.shape[-1] != d or heads % k.shape[1]:
        raise ValueError(f"exact attention: q [S, heads, Tq, d], k and v [S, kv_heads, Tk, d] (with k_index: "
                         f"[rows, kv_heads, d]) with kv_heads dividing heads, got {tuple(q_shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if flat and (k_index.dim() != 2 or k_index.shape[0] != S):
        raise ValueError(f"exact attention: k_index [S, Tk] for q of S = {S}, got {tuple(k_index.shape)}")
    if dtype not in DTYPES or d < 1:  # (a head_dim under 16 is padded to 16 with masked zeros: BLOCK_D)
        raise ValueError(f"exact attention: dtype of {list(DTYPES)} and head_dim >= 1, got {dtype}, {d}")


def _reference(q, k, v, q_pos, k_len, scale):
    """The same attention through SDPA (differentiable), float32 out: what the backward differentiates."""
    keys = torch.arange(k.shape[2], device=q.device)
    visible = (keys[None, None, :] <= q_pos[:, :, None]) & (keys[None, None, :] < k_len[:, None, None])
    seen = visible.any(-1)  # a query that sees nothing outputs 0: its mask opens (no NaN) and its output is zeroed
    visible = visible | ~seen[..., None]
    group = q.shape[1] // k.shape[1]
    k, v = k.to(q.dtype).repeat_interleave(group, 1), v.to(q.dtype).repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], scale=scale)
    return out.float() * seen[:, None, :, None]


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_len: torch.Tensor,
               scale: float, k_index: torch.Tensor | None = None,
               traced: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention`'s output, and each (sequence, head, query) row's log-sum-exp of its scaled scores [S, heads, Tq]
    (float32; +inf for a row that sees no key): what flash attention's backward takes."""
    _check_attention(q.shape, q.dtype, k, v, k_index)
    S, heads, Tq, d = q.shape
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.zeros(S, heads, Tq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((S, heads, Tq), float("inf"), dtype=torch.float32, device=q.device)
    _launch(q, k, v, q_pos.to(torch.int32).contiguous(), k_len, k_index, out, lse, S, Tq, q.stride()[:3],
            out.stride()[:3], lse.stride()[:2], scale, traced=traced)
    return out, lse


def _flat_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, lengths: torch.Tensor,
                    scale: float, traced: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`_attention` of the trainer's flat rows, read and written in place: `q`, `k`, `v` [N, heads or kv_heads, d],
    query and key t of sequence s at row ``index[s, t]`` (t < ``lengths[s]``, at position t). Returns the output
    [N, heads, d] in q's dtype (0 on rows of no sequence; each query's bits those of `_attention` over the gathered
    queries, cast) and each query's log-sum-exp [heads, N] (+inf on rows of no sequence: flash attention's varlen
    layout). No gather of the queries, no scatter of the outputs."""
    S, L = index.shape
    _check_attention((S, q.shape[1], L, q.shape[2]), q.dtype, k, v, index)
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float32, device=q.device)
    # (strides: no sequence stride, a query is a row; the positions are the queries' own indices, unread)
    _launch(q, k, v, lengths, lengths, index, out, lse, S, L, (0, q.stride(1), q.stride(0)),
            (0, out.stride(1), out.stride(0)), (0, lse.stride(0)), scale, flat_queries=True, traced=traced)
    return out, lse


def _launch(q, k, v, q_pos, k_len, k_index, out, lse, S: int, Tq: int, q_strides, out_strides, lse_strides,
            scale: float, flat_queries: bool = False, traced: bool = False) -> None:
    """The attention kernel over S sequences of Tq queries; (sequence, head, position) strides of q and out,
    (sequence, head) of the log-sum-exp (`traced`: the launch a node of the graph being traced)."""
    heads = q.shape[1]
    k, v = (t.to(q.dtype) if t.stride(-1) == 1 else t.to(q.dtype).contiguous() for t in (k, v))
    k_len = k_len.to(torch.int32).contiguous()
    kv_heads, d = k.shape[1], q.shape[-1]
    if k_index is None:
        Tk, index = k.shape[2], q_pos  # (index: an unread stand-in)
        k_strides, v_strides = k.stride()[:3], v.stride()[:3]
    else:  # (sequence, head, position) strides of the flat rows: no sequence stride, a position is a row
        Tk, index = k_index.shape[1], k_index.contiguous()
        k_strides, v_strides = (0, k.stride(1), k.stride(0)), (0, v.stride(1), v.stride(0))
    if S == 0 or Tq == 0 or Tk == 0:
        return
    group = heads // kv_heads
    grid = (cdiv(Tq * group, QUERY_BLOCK), S, kv_heads)
    kernel(_attention_kernel, traced)[grid](
        q, k, v, q_pos, k_len, index, out, lse, Tq, Tk, scale, *q_strides, *k_strides, *v_strides, *out_strides,
        q_pos.stride(0), index.stride(0), *lse_strides, GROUP=group, DIM=d, BLOCK_D=max(16, next_power_of_2(d)),
        BLOCK_M=QUERY_BLOCK, BLOCK_N=KEY_BLOCK, IEEE=q.dtype == torch.float32, INDEXED=k_index is not None,
        FLAT_QUERIES=flat_queries, STATIC_KEYS=Tk if _INTERPRETED else 0, INTERPRETED=_INTERPRETED, num_warps=4,
        num_stages=2)


# --------------------------------------------------------------------------------------------- the trainer's attention
def sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, lengths: torch.Tensor,
                       seq: torch.Tensor, pos: torch.Tensor, real: torch.Tensor, segments: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """Causal attention of each sequence of a trainer's batch over its own tokens, in the layout transformers gives:
    `q` [N, heads, d], `k`, `v` [N, kv_heads, d] a token per row, the sequences (`agents.exact.Sequences`: `index`,
    `lengths`, each row's `seq` and `pos`, `real`, the runs of rows `segments`); returns [N, heads, d] in q's dtype,
    0 on rows of no sequence. The same bits as `attention` over the queries gathered by `index` (what the engine
    computes). The backward is flash attention's varlen backward over every row where it runs (`FLASH_BACKWARD`;
    CUDA, half precision: from this forward's output and log-sum-exp, at the cost of the fast path's backward; a run
    of rows of no sequence has log-sum-exp +inf there, so its gradients are 0), else the SDPA recomputation of
    `attention`'s backward; gradients are not compared bit for bit."""
    return torch.ops.mt_env.exact_sequence_attention(q, k, v, index, lengths, seq, pos, real, segments, scale)[0]


@torch.library.custom_op("mt_env::exact_sequence_attention", mutates_args=())
def _sequence_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, lengths: torch.Tensor,
                 seq: torch.Tensor, pos: torch.Tensor, real: torch.Tensor, segments: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the output [N, heads, d], the log-sum-exp [heads, N] for the backward)."""
    return _flat_attention(q, k, v, index, lengths, scale)


@_sequence_op.register_fake
def _(q, k, v, index, lengths, seq, pos, real, segments, scale):
    _check_attention((index.shape[0], q.shape[1], index.shape[1], q.shape[2]), q.dtype, k, v, index)
    return q.new_empty(q.shape), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


def _sequence_setup(ctx, inputs, output):
    q, k, v, index, lengths, seq, pos, real, segments, ctx.scale = inputs
    ctx.save_for_backward(q, k, v, index, lengths, seq, pos, real, segments, *output)


def _sequence_backward(ctx, grad, _):
    q, k, v, index, lengths, seq, pos, real, segments, out, lse = ctx.saved_tensors
    if _flash_backward_runs(q):
        grads = _flash_backward(grad, q, k, v, out, lse, segments, index.shape[1], ctx.scale)
    else:
        grads = _reference_backward(grad, q, k, v, index, lengths, seq, pos, real, ctx.scale, ctx.needs_input_grad)
    return (*grads, *(None,) * 7)


def _flash_backward(grad, q, k, v, out, lse, segments, longest, scale):
    """Flash attention's varlen backward over every flat row, run by run (`segments`, none longer than `longest`),
    from the forward's output and log-sum-exp, read and written in place: a run of rows of no sequence (output 0,
    log-sum-exp +inf) gets gradients 0."""
    philox = torch.zeros(2, dtype=torch.uint64, device=q.device)  # the RNG state: unread without dropout
    return torch.ops.aten._flash_attention_backward(
        grad.contiguous(), q, k, v, out, lse, segments, segments, longest, longest, 0.0, True, philox, philox,
        scale=scale)  # (dq, dk, dv)


def _reference_backward(grad, q, k, v, index, lengths, seq, pos, real, scale, needs_input_grad):
    """The gradients of the same attention recomputed with SDPA under the mask (`_reference`), where flash's backward
    does not run."""
    inputs = [t.detach().requires_grad_(need) for t, need in zip((q, k, v), needs_input_grad[:3])]
    S, L = index.shape
    with torch.enable_grad():
        queries, keys, values = (t[index].transpose(1, 2) for t in inputs)
        attended = _reference(queries, keys, values, torch.arange(L, device=q.device).expand(S, L), lengths, scale)
        flat = attended.to(q.dtype).transpose(1, 2)[seq, pos]
        flat = torch.where(real[:, None, None], flat, flat.new_zeros(()))
    wanted = [t for t in inputs if t.requires_grad]
    grads = iter(torch.autograd.grad(flat, wanted, grad) if wanted else ())
    return tuple(next(grads) if t.requires_grad else None for t in inputs)


_sequence_op.register_autograd(_sequence_backward, setup_context=_sequence_setup)
inline(_sequence_op, lambda q, k, v, index, lengths, seq, pos, real, segments, scale, traced:
       _flat_attention(q, k, v, index, lengths, scale, traced))


def _flash_backward_runs(q: torch.Tensor) -> bool:
    """Whether `sequence_attention`'s backward is flash attention's for `q` ([N, heads, d]): `FLASH_BACKWARD` on,
    flash runs there (`_flash_supported`) and gave the recomputation's gradients there (`flash_backward_agrees`)."""
    return (FLASH_BACKWARD and _flash_supported(q.device, q.dtype, q.shape[-1])
            and _FLASH_AGREES.get((q.device.index, q.dtype, q.shape[-1]), False))


def _flash_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """CUDA, half precision, head_dim a multiple of 8 up to 256, compute capability 8.0 or more (Ampere on)."""
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0
            and head_dim <= 256 and torch.cuda.get_device_capability(device)[0] >= 8)


#: (device index, dtype, head_dim) -> whether flash's backward gave the recomputation's gradients there
_FLASH_AGREES: dict[tuple[Optional[int], torch.dtype, int], bool] = {}


def flash_backward_agrees(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `sequence_attention` differentiates by flash attention's backward on `device` for `dtype` and
    `head_dim`: `FLASH_BACKWARD` on, flash supported there, and its gradients on a small packed GQA problem within 2%
    (of the largest) of the SDPA recomputation's, checked once per key; a disagreement or an error warns, and the
    recomputation serves. Call it eagerly before a forward whose backward will run (`PolicyModel` does): the
    backward, compiled or not, only reads the answer."""
    device = torch.device(device)
    if not (FLASH_BACKWARD and _flash_supported(device, dtype, head_dim)):
        return False
    key = (device.index, dtype, head_dim)
    if key not in _FLASH_AGREES:
        try:
            _FLASH_AGREES[key] = _flash_matches_reference(device, dtype, head_dim)
        except RuntimeError as error:  # a flash build that refuses these arguments: the recomputation serves
            warnings.warn(f"exact mode: flash attention's backward failed its check ({error}); the attention's "
                          "backward recomputes with SDPA", stacklevel=2)
            _FLASH_AGREES[key] = False
        if not _FLASH_AGREES[key]:
            warnings.warn(f"exact mode: flash attention's backward disagrees with the recomputation on {device} "
                          f"({dtype}, head_dim {head_dim}); the attention's backward recomputes with SDPA",
                          stacklevel=2)
    return _FLASH_AGREES[key]


def _flash_matches_reference(device: torch.device, dtype: torch.dtype, d: int) -> bool:
    """Three sequences (37, 64 and 1 tokens) packed in a row with rows of no sequence between and after them, 4 query
    heads over 2 KV heads: both backwards of `sequence_attention` from one forward, each gradient within 2% (of the
    largest) of the recomputation's."""
    from .exact import sequences  # (here: agents.exact imports this module)

    lengths, gaps = (37, 64, 1), (5, 0, 3)
    position_ids = torch.cat([torch.cat([torch.arange(n), torch.zeros(gap, dtype=torch.long)])
                              for n, gap in zip(lengths, gaps)]).to(device)
    real = torch.cat([torch.arange(n + gap) < n for n, gap in zip(lengths, gaps)]).to(device)
    layout = sequences(position_ids[None], real[None])
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad = (torch.randn(len(real), h, d, generator=gen, device=device).to(dtype) for h in (4, 2, 2, 4))
    fields = (layout.index, layout.lengths, layout.seq, layout.pos, layout.real)
    out, lse = torch.ops.mt_env.exact_sequence_attention(q, k, v, *fields, layout.segments, d ** -0.5)
    flash = _flash_backward(grad, q, k, v, out, lse, layout.segments, layout.index.shape[1], d ** -0.5)
    reference = _reference_backward(grad, q, k, v, *fields, d ** -0.5, (True,) * 3)
    return all(bool((a.float() - b.float()).abs().max() <= 0.02 * b.float().abs().max()) and bool(a.isfinite().all())
               for a, b in zip(flash, reference))


# --------------------------------------------------------------------------------------------- row sum
@triton.jit
def _halving_sum(x, LEVELS: tl.constexpr):
    """The sum of `x` [2**LEVELS] by pairwise halving, x[:h] + x[h:] until one is left: a tree set by the length
    alone. Why not `tl.sum`: its tree follows how the compiler spreads the lanes over threads, which follows the
    input's dtype and alignment (a bfloat16 row and its float32 copy were summed in different orders on an H100).
    A sum of two does not depend on which thread adds it, so neither does this tree."""
    for _ in tl.static_range(LEVELS):
        x = tl.sum(tl.reshape(x, [2, x.shape[0] // 2]), 0)
    return tl.sum(x, 0)  # (one element)


@triton.jit(do_not_specialize=["n"])
def _row_sum_kernel(x_ptr, out_ptr, n, stride_row, BLOCK: tl.constexpr, LEVELS: tl.constexpr,
                    STATIC_N: tl.constexpr, INTERPRETED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, STATIC_N if INTERPRETED else n, BLOCK):  # each lane adds its elements in order
        at = start + lanes
        acc += tl.load(x_ptr + row * stride_row + at, mask=at < n, other=0.0)
    tl.store(out_ptr + row, _halving_sum(acc, LEVELS))  # one tree over the lanes, fixed by BLOCK


def row_sum(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """The sum of float32 `x` over its last dimension, in an order set by that dimension's length alone (a row's bits
    do not depend on the other rows). Differentiable."""
    return torch.ops.mt_env.exact_row_sum(x, keepdim)


@torch.library.custom_op("mt_env::exact_row_sum", mutates_args=())
def _row_sum_op(x: torch.Tensor, keepdim: bool) -> torch.Tensor:
    return _row_sum(x, keepdim)


@_row_sum_op.register_fake
def _(x, keepdim):
    _check_row_sum(x)
    return x.new_empty(*x.shape[:-1], *((1,) if keepdim else ()))


def _row_sum_setup(ctx, inputs, output):
    ctx.shape, ctx.keepdim = inputs[0].shape, inputs[1]


def _row_sum_backward(ctx, grad):
    return (grad if ctx.keepdim else grad.unsqueeze(-1)).expand(ctx.shape), None


_row_sum_op.register_autograd(_row_sum_backward, setup_context=_row_sum_setup)


def _check_row_sum(x: torch.Tensor) -> None:
    if x.dtype != torch.float32:
        raise ValueError(f"exact row_sum: float32 in, got {x.dtype}")


def _row_sum(x: torch.Tensor, keepdim: bool, traced: bool = False) -> torch.Tensor:
    _check_row_sum(x)
    n = x.shape[-1]
    rows = x.reshape(-1, n) if n else x.reshape(-1, 1)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.zeros(rows.shape[0], dtype=torch.float32, device=x.device)
    if rows.shape[0] and n:
        block = min(SUM_BLOCK, next_power_of_2(n))
        kernel(_row_sum_kernel, traced)[(rows.shape[0],)](
            rows, out, n, rows.stride(0), BLOCK=block, LEVELS=block.bit_length() - 1,
            STATIC_N=n if _INTERPRETED else 0, INTERPRETED=_INTERPRETED, num_warps=4 if block >= 512 else 1)
    return out.reshape(*x.shape[:-1], *((1,) if keepdim else ()))


inline(_row_sum_op, _row_sum)


# --------------------------------------------------------------------------------------------- softmax statistics
@triton.jit(do_not_specialize=["n"])
def _softmax_stats_kernel(x_ptr, temp_ptr, out_ptr, n, stride_row, BLOCK: tl.constexpr, LEVELS: tl.constexpr,
                          STATIC_N: tl.constexpr, INTERPRETED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    temperature = tl.load(temp_ptr + row)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, STATIC_N if INTERPRETED else n, BLOCK):  # the max: exact in any order
        at = start + lanes
        x = tl.load(x_ptr + row * stride_row + at, mask=at < n, other=float("-inf")).to(tl.float32)
        best = tl.maximum(best, tl.math.div_rn(x, temperature))  # IEEE division: torch's z = x / T, bit for bit
    top = tl.max(best, 0)
    total = tl.zeros([BLOCK], tl.float32)
    weighted = tl.zeros([BLOCK], tl.float32)
    for start in range(0, STATIC_N if INTERPRETED else n, BLOCK):  # each lane adds its elements in order
        at = start + lanes
        inside = at < n
        z = tl.math.div_rn(tl.load(x_ptr + row * stride_row + at, mask=inside, other=0.0).to(tl.float32), temperature)
        e = tl.where(inside, tl.exp(z - top), 0.0)
        total += e
        weighted += e * z
    tl.store(out_ptr + row * 3, top)
    tl.store(out_ptr + row * 3 + 1, _halving_sum(total, LEVELS))  # one tree over the lanes, fixed by BLOCK
    tl.store(out_ptr + row * 3 + 2, _halving_sum(weighted, LEVELS))


def softmax_stats(x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """`agents.exact.softmax_stats`'s contract for `x` [N, V] (bfloat16, float16 or float32; rows may be strided) and
    float32 `temperature` [N]: float32 [N, 3] of (m, s, w) per row: the max of z = x / T, the sum of exp(z - m) in an
    order set by V alone (lanes of `SUM_BLOCK`, then one tree), and the sum of exp(z - m) * z. Not differentiable."""
    return torch.ops.mt_env.exact_softmax_stats(x, temperature)


@torch.library.custom_op("mt_env::exact_softmax_stats", mutates_args=())
def _softmax_stats_op(x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    _check_softmax_stats(x, temperature)
    n = x.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    temperature = temperature.to(torch.float32).contiguous()
    out = torch.empty(x.shape[0], 3, dtype=torch.float32, device=x.device)
    if x.shape[0]:
        block = min(SUM_BLOCK, next_power_of_2(n))
        _softmax_stats_kernel[(x.shape[0],)](x, temperature, out, n, x.stride(0), BLOCK=block,
                                             LEVELS=block.bit_length() - 1, STATIC_N=n if _INTERPRETED else 0,
                                             INTERPRETED=_INTERPRETED,
                                             num_warps=4 if block >= 512 else 1)
    return out


@_softmax_stats_op.register_fake
def _(x, temperature):
    _check_softmax_stats(x, temperature)
    return x.new_empty(x.shape[0], 3, dtype=torch.float32)


def _check_softmax_stats(x: torch.Tensor, temperature: torch.Tensor) -> None:
    if x.dim() != 2 or temperature.shape != x.shape[:1] or x.dtype not in DTYPES or x.shape[1] == 0:
        raise ValueError(f"exact softmax_stats: x [N, V > 0] of a dtype of {list(DTYPES)} and temperature "
                         f"[N], got {tuple(x.shape)} {x.dtype} and {tuple(temperature.shape)}")
