"""DSQ's attention products in tiles of query rows (docs/dsq.md, "Attention in tiles").

The definition is the explicit path, `explicit_attention`: per head, with ``q [B, H, N, d]``,
``k [B, Hkv, M, d]``, ``v [B, Hkv, M, e]`` (grouped-query attention: query head ``h`` reads
key/value head ``h // (H / Hkv)``)

    S  = dsq_matmul(Q, K^T) * scaling      + an additive mask, or -inf where a boolean mask
                                            (or the causal rule j <= i) forbids
    P  = softmax(S) in float32             a row with nothing to attend to is all zeros
    Pd = dropout(P)
    O  = dsq_matmul(Pd, V)

so its backward pass holds ``P`` and the stash of ``Pd``, each ``H x N x M``: memory that grows
with the square of the sequence.

`dsq_attention` computes the same values a block of query rows at a time (a *tile*: every key of
some rows, of some sequences of the batch), and holds nothing ``N x M`` beyond one tile:

* forward: ``q0(Q)``, ``q0(K)`` (blocks along ``d``) and ``q0(V)`` (blocks along the keys) are
  quantized whole, as the explicit path does, and per tile the rows of ``S``, ``P`` (torch's
  softmax over whole rows, so the same values) and ``Pd`` are formed, ``Pd`` quantized in q0
  with blocks along the keys and multiplied by ``q0(V)``;
* saved for the backward pass: ``Q`` and ``K`` packed in q0 (to form ``S`` again) and the
  explicit path's stashes of ``Q`` (q1, blocks along the queries), ``K`` (q1, along the keys) and
  ``V`` (q1, along ``d``): ``(H + Hkv) d (b0 + b1) + Hkv e b1`` bits a token and layer, b0 and b1
  q0's and q1's bits a value; nothing of ``P``;
* backward, per tile: ``S``, ``P`` and ``Pd`` again (the forward's values), then the explicit
  path's gradient GEMMs on the tile: ``dPd = q2(g_O) q1(V)^T``, ``dV += q1(Pd)^T g_O`` (q1 with
  blocks along the queries), softmax's backward over whole rows, ``g = q3(dS * scaling)`` (along
  the queries) and ``q2(g)`` (along the keys), ``dQ = q2(g) q1(K)``, ``dK += g^T q1(Q)``.

Tiles start at multiples of every format's block, so a block along the queries never straddles
two tiles, and a format whose scale spans the tensor (``fixed<w>``, NVFP4: ``whole_tensor_scale``)
is given the whole tensor's largest magnitude, found by a pass over the tiles first, so each
quantized value equals the explicit path's. What differs is the order of float32 sums: a GEMM
over a tile's rows instead of all rows, ``dK`` and ``dV`` summed tile by tile and over a group's
query heads. tests/dsq/engine/test_attention.py states the tolerance.

The stashes are packed, and the backward pass runs, a group of sequences at a time
(`stash_groups`: a tile's sequences), so the unpacked stashes exist for one group; a whole-tensor
q3 is given the batch's largest magnitudes of dO and dZ (`attention_score_gradient_magnitude`),
so each group's values are the whole batch's.

The two passes are torch custom ops, ``dsq::attention_forward`` and ``dsq::attention_backward``
(`attention_forward`, `attention_backward`), on tensors already in their formats; the autograd
function around them packs and unpacks the stashes.

Dropout draws its keep mask from a counter-based hash of (seed, sequence, head, query, key), so
the mask, and the result, do not depend on the tiling; its stream is not ``F.dropout``'s. A
stochastic rounding draws its noise tile by tile, and ``q1(Pd)`` in the backward pass, from a
generator each pass seeds with a draw from the config's: equal in distribution to the explicit
path's, not value for value.
"""

from __future__ import annotations

import functools
import logging
import math

import torch

from dsq.formats import Format, backends, parse_format
from dsq.warn_once import warn_once

from . import accounting, units
from .config import POINTS, QuantConfig
from .functions import (
    _Point,
    _points,
    _stash_header,
    _stash_restore,
    backward_outside_autocast,
    dsq_matmul,
    outside_autocast,
)
from .parts import (
    finite_largest_magnitude,
    largest_magnitude,
    quantize_chain_part,
    quantize_part,
)

# the elements of one tile's [rows x keys] tensors across its sequences and heads: a few such
# tensors are alive at once, about 8 MiB each, whatever the batch
TILE_ELEMENTS = 2**21

LOGGER = __name__
log = logging.getLogger(LOGGER)


# -- the definition -----------------------------------------------------------------------------
def repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``x [B, Hkv, M, e]`` with each key/value head repeated for its ``heads / Hkv`` query
    heads (``transformers``' ``repeat_kv``)."""
    rep = heads // x.shape[1]
    if rep == 1:
        return x
    b, hkv, m, e = x.shape
    return x[:, :, None].expand(b, hkv, rep, m, e).reshape(b, hkv * rep, m, e)


def keep_mask(mask, causal: bool, key_padding, n: int, m: int, device) -> torch.Tensor | None:
    """Where a query may attend: a boolean ``mask``, or the causal rule ``j <= i`` when there is
    no mask, and not a padded key (``key_padding [B, M]``, True where padded); None when
    nothing is forbidden but by an additive mask."""
    keep = None
    if mask is not None:
        keep = mask if mask.dtype == torch.bool else None
    elif causal:
        keep = torch.ones(n, m, dtype=torch.bool, device=device).tril()
    if key_padding is not None:
        real = ~key_padding.bool()[:, None, None, :]
        keep = real if keep is None else keep & real
    return keep


def explicit_attention(q, k, v, cfg: QuantConfig | None, *, scaling: float, mask=None,
                       causal: bool = False, key_padding=None, dropout: float = 0.0,
                       training: bool = False, dropout_fn=None):  # fmt: skip
    """The definition (module docstring), with ``S x S`` tensors: returns ``(O, Pd)``.
    ``cfg`` None computes it in ``torch.matmul``; ``dropout_fn(P)`` replaces ``F.dropout``."""
    matmul = torch.matmul if cfg is None else (lambda a, b: dsq_matmul(a, b, cfg))
    heads = q.shape[1]
    k, v = repeat_heads(k, heads), repeat_heads(v, heads)
    scores = matmul(q, k.transpose(-1, -2)) * scaling
    keep = keep_mask(mask, causal, key_padding, q.shape[-2], k.shape[-2], q.device)
    if mask is not None and mask.dtype != torch.bool:
        scores = scores + mask
    if keep is not None:
        nothing = ~keep.any(-1, keepdim=True)
        scores = scores.masked_fill(~keep, -torch.inf).masked_fill(nothing, 0.0)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if keep is not None:
        probs = probs.masked_fill(nothing, 0.0)
    if dropout_fn is not None:
        probs = dropout_fn(probs)
    else:
        probs = torch.nn.functional.dropout(probs, p=dropout, training=training)
    return matmul(probs, v), probs


# -- dropout that does not depend on the tiling ---------------------------------------------------
_GOLDEN, _MIX1, _MIX2 = (c - 2**64 for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                             0x94D049BB133111EB))  # fmt: skip


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's ``>>`` is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def dropout_noise(seed: int, p: float, index: torch.Tensor) -> torch.Tensor:
    """``keep / (1 - p)`` (float32) at the int64 counters ``index``: keep where the top 24 bits
    of splitmix64(seed + index) are at least ``p * 2^24``."""
    z = index + (seed + _GOLDEN)
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    keep = _shr(z, 40) >= round(p * 2**24)
    return keep.to(torch.float32).div_(1 - p)


def dropout_index(shape, heads: int, n: int, m: int, b0: int, i0: int, device) -> torch.Tensor:
    """The counter of each element of a tile ``[bc, Hkv, rep, rows, keys]`` (sequences from
    ``b0``, rows from ``i0``): ``((b H + h) N + i) M + j``, its place in ``[B, H, N, M]``."""
    bc, hkv, rep, rows, keys = shape
    b = torch.arange(b0, b0 + bc, device=device).view(-1, 1, 1, 1, 1)
    h = (torch.arange(hkv, device=device).view(1, -1, 1, 1, 1) * rep
         + torch.arange(rep, device=device).view(1, 1, -1, 1, 1))  # fmt: skip
    i = torch.arange(i0, i0 + rows, device=device).view(1, 1, 1, -1, 1)
    j = torch.arange(keys, device=device).view(1, 1, 1, 1, -1)
    return ((b * heads + h) * n + i) * m + j


# -- the tiled kernel ---------------------------------------------------------------------------
class _Tiles:
    """The tiles of one call: rows ``tile_rows`` at a time (a multiple of every block), and as
    many sequences as keep a tile within `TILE_ELEMENTS`."""

    def __init__(self, b, heads, n, m, formats, causal: bool, tile_rows=None):
        multiple = 1
        for fmt in formats:
            block = getattr(fmt, "block", None)
            multiple = math.lcm(multiple, block or 1)
        if tile_rows is None:
            tile_rows = max(1, TILE_ELEMENTS // max(1, heads * m))
        # a tile of fewer rows than the sequence starts and ends on block boundaries
        self.rows = min(n, max(multiple, tile_rows // multiple * multiple))
        self.seqs = max(1, TILE_ELEMENTS // max(1, heads * self.rows * m))
        self.b, self.n, self.m, self.multiple, self.causal = b, n, m, multiple, causal

    def __iter__(self):
        """(sequences, rows, keys) of each tile. Under the causal rule a tile's keys end at the
        block boundary after its last row: every later key is forbidden, its probability 0."""
        for b0 in range(0, self.b, self.seqs):
            for i0 in range(0, self.n, self.rows):
                i1 = min(i0 + self.rows, self.n)
                last = -(-i1 // self.multiple) * self.multiple if self.causal else self.m
                yield (
                    slice(b0, min(b0 + self.seqs, self.b)),
                    slice(i0, i1),
                    slice(0, min(last, self.m)),
                )


class _Call:
    """What a forward pass fixed for its backward pass: shapes, masks, points, plans, the
    dropout seed and the largest magnitudes of the tensors a whole-tensor scale spans."""

    def __init__(self, q, k, v, points, gemm_unit, scaling, mask, causal, key_padding, dropout,
                 dropout_seed, tile_rows, first_sequence=0):  # fmt: skip
        self.batch, self.heads, self.n, self.d = q.shape
        self.kv_heads, self.m, self.e = k.shape[1], k.shape[2], v.shape[-1]
        self.rep = self.heads // self.kv_heads
        self.scaling, self.dropout = scaling, dropout
        # a power of two scales a product exactly, so it can scale an operand once instead of
        # every tile's scores and score gradients (1/8 for heads of 64; fairseq's 1, its q scaled)
        self.folded = scaling > 0 and math.frexp(scaling)[0] == 0.5
        self.points = points
        f0, f1, f2, f3 = (p.fmt for p in self.points)
        self.tiles = _Tiles(self.batch, self.heads, self.n, self.m, (f0, f1, f2, f3),
                            causal and mask is None, tile_rows)  # fmt: skip
        qk, pv = self.n * self.d * self.m, self.n * self.m * self.e
        self.plans_qk = _plans(f0, f1, f2, f3, q.device, gemm_unit, qk)
        self.plans_pv = _plans(f0, f1, f2, f3, q.device, gemm_unit, pv)
        # a boolean or an additive mask as [B, Hkv, rep, N, M] views; the causal rule is formed
        # tile by tile, never N x M
        boolean = mask is not None and mask.dtype == torch.bool
        self.additive = None if mask is None or boolean else self._five(mask)
        self.keep = self._five(mask) if boolean else None
        self.causal = causal and mask is None
        self.real_keys = None if key_padding is None else ~key_padding.bool()[:, None, None, None]
        self.seed = dropout_seed if dropout > 0 else None
        # where the call is one group of a batch's sequences (`stash_groups`): the first one's
        # place in the batch, for dropout's counters, and the whole batch's largest magnitudes of
        # dO and dZ where q3 scales the whole tensor (None: the call finds them itself)
        self.first_sequence = first_sequence
        self.amax_pd = self.amax_out = self.amax_dz = None

    def _five(self, mask):
        """``mask`` (broadcastable to [B, H, N, M]) as a view [B, Hkv, rep, N, M]."""
        full = mask.expand(self.batch, self.heads, self.n, self.m)
        return full.view(self.batch, self.kv_heads, self.rep, self.n, self.m)

    def rows_of(self, x, bs, rows):
        """Rows ``rows`` of sequences ``bs`` of a per-query-head tensor ``[B, H, N, c]`` as the
        GEMM layout ``[bc, Hkv, rep * rows, c]``."""
        part = x.view(self.batch, self.kv_heads, self.rep, self.n, x.shape[-1])[bs, :, :, rows]
        return part.reshape(part.shape[0], self.kv_heads, -1, x.shape[-1])

    def probs(self, q0, k0_t, bs, rows, keys):
        """(P, Pd, noise, keep, nothing) of a tile, [bc, Hkv, rep, rows, keys]: the forward's
        values (``k0_t``: q0(K) transposed, [B, Hkv, d, M])."""
        plan = self.plans_qk[0]
        s = units.gemm(self.rows_of(q0, bs, rows), k0_t[bs, :, :, keys], plan, "matmul.forward")
        s = s.view(s.shape[0], self.kv_heads, self.rep, -1, s.shape[-1])
        if not self.folded:
            s = s * self.scaling
        nothing = keep = None
        if self.additive is not None:
            s = s + self.additive[bs, :, :, rows, keys]
        if self.causal and self.real_keys is None:
            # only a key from the tile's first row on can come after a row: that part alone is
            # masked, in place (``s`` is this tile's own)
            i0 = rows.start
            i = torch.arange(i0, i0 + s.shape[-2], device=s.device)
            later = torch.arange(i0, max(i0, keys.stop), device=s.device) > i[:, None]
            s[..., i0:].masked_fill_(later, -torch.inf)
        elif self.causal:
            i = torch.arange(rows.start, rows.start + s.shape[-2], device=s.device)
            keep = torch.arange(keys.stop, device=s.device) <= i[:, None]
        elif self.keep is not None:
            keep = self.keep[bs, :, :, rows, keys]
        if self.real_keys is not None:
            real = self.real_keys[bs, ..., keys]
            keep = real if keep is None else keep & real
        if keep is not None:
            s = s.masked_fill(~keep, -torch.inf)
            if self.keep is not None or self.real_keys is not None:  # causal rows keep key 0
                nothing = ~keep.any(-1, keepdim=True)
                s = s.masked_fill(nothing, 0.0)
        # in float32, then in the inputs' dtype, as the explicit path's softmax
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(s.dtype)
        if nothing is not None:
            p = p.masked_fill(nothing, 0.0)
        noise = None
        if self.seed is not None:
            index = dropout_index(p.shape, self.heads, self.n, self.m,
                                  self.first_sequence + bs.start, rows.start, p.device)  # fmt: skip
            noise = dropout_noise(self.seed, self.dropout, index)
        # the noise is float32: the product is rounded once to the probabilities' dtype
        pd = p if noise is None else (p * noise).to(p.dtype)
        return p, pd, noise, keep, nothing

    def scaled(self, x: torch.Tensor, keep=()) -> torch.Tensor:
        """``x`` times the scaling where it is folded into an operand (``folded``): in place
        where ``x`` shares no memory with the tensors of ``keep`` (those whose values must stay:
        a caller's input, a stash ``x`` was unpacked from), which spares a copy of a whole
        per-head tensor."""
        if not self.folded:
            return x
        if any(_shares_memory(x, t) for t in keep):
            return x * self.scaling
        return x.mul_(self.scaling)

    def merged(self, x):
        """A tile [bc, Hkv, rep, rows, c] in the GEMM layout [bc, Hkv, rep * rows, c]."""
        return x.reshape(x.shape[0], self.kv_heads, -1, x.shape[-1])


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share storage; under torch.compile, which cannot read a storage's
    address, assumed (a caller then writes to a copy, which is always correct)."""
    if torch.compiler.is_compiling():
        return True
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _whole_scale(point: _Point) -> bool:
    return point.fmt.whole_tensor_scale


def _forward(call: _Call, q0, k0, v0):
    """O [B, H, N, e] from the q0-quantized operands (``v0`` [B, Hkv, M, e]); ``q0`` is scaled
    in place unless it shares memory with ``k0`` or ``v0``."""
    f0, f1 = call.points[0], call.points[1]
    k0_t, q0 = k0.transpose(-1, -2), call.scaled(q0, (k0, v0))
    if _whole_scale(f0) or _whole_scale(f1):  # q0(Pd) or its stash needs Pd's largest value
        call.amax_pd = _largest_of([largest_magnitude(call.probs(q0, k0_t, *tile)[1])
                                    for tile in call.tiles], q0)  # fmt: skip
    out = q0.new_empty(call.batch, call.heads, call.n, call.e)
    five = out.view(call.batch, call.kv_heads, call.rep, call.n, call.e)
    amax = call.amax_pd if _whole_scale(f0) else None
    for bs, rows, keys in call.tiles:
        pd = call.probs(q0, k0_t, bs, rows, keys)[1]
        pd0 = quantize_part(f0, pd, -1, amax)
        o = units.gemm(call.merged(pd0), v0[bs, :, keys], call.plans_pv[0], "matmul.forward")
        five[bs, :, :, rows] = o.view(o.shape[0], call.kv_heads, call.rep, -1, call.e)
        del pd, pd0, o  # freed before the next tile makes its own (as in `_backward`)
    return out


def _backward(call: _Call, d_out, q0, k0, q1, k1, v1):
    """(dQ, dK, dV) from the incoming gradient and the saved operands; ``q0`` is scaled in place
    unless it shares memory with another input."""
    f0, f1, f2, f3 = call.points
    g_out_of, whole = _incoming_gradient(call, d_out, (k0, q1, k1, v1))
    keep = (d_out, k0, q1, k1, v1, *whole)
    d_scores_of = _tile_gradients(call, q0, k0, v1, keep)

    amax_dz = amax_g = None
    if _whole_scale(f3):
        amax_dz = call.amax_dz
        if amax_dz is None:
            amax_dz = _largest_score_gradient(call, q0, g_out_of, d_scores_of)
    if _whole_scale(f2):
        amax_g = _largest_score_gradient(call, q0, g_out_of, d_scores_of, amax_dz)
    dq = torch.empty_like(q0)
    dq5 = dq.view(call.batch, call.kv_heads, call.rep, call.n, call.d)
    dk_t = q0.new_zeros(call.batch, call.kv_heads, call.d, call.m)
    dv = q0.new_zeros(call.batch, call.kv_heads, call.m, call.e)
    amax_pd = call.amax_pd if _whole_scale(f1) else None
    for bs, rows, keys in call.tiles:
        g_out, g2_out = g_out_of(bs, rows)
        dz, pd = d_scores_of(bs, rows, keys, g2_out)
        # dV += q1(Pd)^T g_O: Pd's stash, blocks along the queries
        pd1 = call.merged(quantize_part(f1, pd, -2, amax_pd))
        dv[bs, :, keys] += units.gemm(pd1.transpose(-1, -2), g_out, call.plans_pv[2],
                                      "matmul.db")  # fmt: skip
        # g = q3(dZ) along the queries, then q2(g) along the keys
        g, g2 = quantize_chain_part(f3, f2, dz, amax_dz, amax_g)
        dq_tile = units.gemm(call.merged(g2), k1[bs, :, keys], call.plans_qk[1], "matmul.da")
        dq5[bs, :, :, rows] = dq_tile.view(dq_tile.shape[0], call.kv_heads, call.rep, -1,
                                           call.d)  # fmt: skip
        q1_rows = call.rows_of(q1, bs, rows).transpose(-1, -2)
        dk_t[bs, :, :, keys] += units.gemm(q1_rows, call.merged(g), call.plans_qk[2],
                                           "matmul.db")  # fmt: skip
        # this tile's temporaries freed before the next tile makes its own, or two tiles' worth
        # are alive at once
        del g_out, g2_out, dz, pd, pd1, g, g2, dq_tile, q1_rows
    return dq, dk_t.transpose(-1, -2), dv


def _largest_score_gradient(call: _Call, q0, g_out_of, d_scores_of, amax_dz=None):
    """The largest magnitude of dZ over the call's tiles, or of ``q3(dZ)`` (blocks along the
    queries) where ``amax_dz``, dZ's, is given: a pass for a scale that spans the tensor."""
    f3 = call.points[3]
    largest = []
    for bs, rows, keys in call.tiles:
        dz = d_scores_of(bs, rows, keys, g_out_of(bs, rows)[1])[0]
        largest.append(largest_magnitude(dz if amax_dz is None else
                                         quantize_part(f3, dz, -2, amax_dz)))  # fmt: skip
        del dz
    return _largest_of(largest, q0)


def _largest_of(magnitudes: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The largest of the tiles' magnitudes; 0 where there is no tile (an empty batch)."""
    return torch.stack(magnitudes).amax() if magnitudes else like.new_zeros(())


def _incoming_gradient(call: _Call, d_out, keep):
    """(a function of a tile's sequences and rows, the whole tensors it holds): the function
    gives ``(g_O, q2(g_O) * scaling)`` there in the GEMM layout [bc, Hkv, rep * rows, e],
    ``g_O = q3(dO)`` with blocks along the queries and ``q2(g_O)`` along e, the scaling folded
    where it is (`_Call.folded`).

    Where both points round to nearest, each tile's part is quantized on its own: its rows start
    on every block's boundary and a scale spanning the tensor is given the whole tensor's largest
    magnitude (`quantize_chain_part`), so each value is the whole tensor's, and nothing of dO's
    size is made. Stochastic rounding draws its noise for the whole tensor, as the explicit path
    does, so there both are made whole (dO made contiguous for them, that copy freed at once);
    so are they where dO holds a NaN or an infinity, which a scale spanning the tensor spreads
    to every value of it."""
    f2, f3 = call.points[2], call.points[3]
    whole = f3.rounding != "nearest" or f2.rounding != "nearest" or d_out.numel() == 0
    amax = None
    if not whole:  # a group's call is given the batch's, found finite (`stash_groups`)
        amax = call.amax_out if call.amax_out is not None else finite_largest_magnitude(d_out)
    if amax is None:
        g_out, g2_out = _whole_incoming_gradient(call, d_out)
        g2_out = call.scaled(g2_out, (d_out, g_out, *keep))

        def of_whole(bs, rows):
            return call.rows_of(g_out, bs, rows), call.rows_of(g2_out, bs, rows)

        return of_whole, (g_out, g2_out)
    amax_out = amax if _whole_scale(f3) else None
    # [B, Hkv, rep, N, e]: each head's rows apart, so that a tile's blocks along the queries are
    # the whole tensor's (a view where dO's strides allow it, as they do for a transposed
    # [B, N, H, e]; else one copy)
    shape = (call.batch, call.kv_heads, call.rep, call.n, call.e)
    try:
        five = d_out.view(shape)
    except RuntimeError:
        five = d_out.contiguous().view(shape)

    def rows_of_d_out(bs, rows):
        return five[bs, :, :, rows].clone()  # a copy: lending its first value writes into it

    amax_g_out = None
    if _whole_scale(f2):
        amax_g_out = torch.stack([
            largest_magnitude(quantize_part(f3, rows_of_d_out(bs, rows), -2, amax_out))
            for bs, rows, _ in call.tiles
        ]).amax()  # fmt: skip

    def of_tile(bs, rows):
        g, g2 = quantize_chain_part(f3, f2, rows_of_d_out(bs, rows), amax_out, amax_g_out)
        return call.merged(g), call.merged(call.scaled(g2, (g,)))

    return of_tile, ()


def _whole_incoming_gradient(call: _Call, d_out):
    """``(q3(dO), q2(q3(dO)))`` of the whole tensor, blocks along the queries then along e (dO
    made contiguous for them, that copy freed once they are made)."""
    f2, f3 = call.points[2], call.points[3]
    return f3.quantize_chain(d_out.contiguous(), -2, f2, -1)


def _tile_gradients(call: _Call, q0, k0, v1, keep=()):
    """A function of a tile and its ``q2(g_O) * scaling`` rows (`_incoming_gradient`): (dZ, Pd),
    dZ = dS * scaling the gradient of the scores' GEMM and Pd the dropped-out probabilities,
    [bc, Hkv, rep, rows, M]. ``q0`` is scaled in place unless it shares memory with a tensor of
    ``keep``."""

    k0_t, v1_t = k0.transpose(-1, -2), v1.transpose(-1, -2)
    # dPd scaled: dS scaled by linearity
    q0 = call.scaled(q0, keep)

    def of(bs, rows, keys, g2_out_rows):
        p, pd, noise, keep, nothing = call.probs(q0, k0_t, bs, rows, keys)
        d_pd = units.gemm(g2_out_rows, v1_t[bs, :, :, keys], call.plans_pv[1], "matmul.da")
        d_p = d_pd.view_as(p) if noise is None else (d_pd.view_as(p) * noise).to(p.dtype)
        if nothing is not None:
            d_p = d_p.masked_fill(nothing, 0.0)
        d_s = torch._softmax_backward_data(d_p, p, -1, p.dtype)
        # forbidden keys have P = 0, so their dS is 0 already; an empty row's is set to 0
        if nothing is not None:
            d_s = d_s.masked_fill(~keep, 0.0).masked_fill(nothing, 0.0)
        return (d_s if call.folded else d_s * call.scaling), pd

    return of


# -- the kernels as torch custom ops --------------------------------------------------------------
# dsq::attention_forward and dsq::attention_backward are the tiled kernel's two passes on tensors
# already in their formats: torch.compile traces each as one op (its fake gives the outputs'
# shapes), the profiler names them, and another backend registers its kernel under the same op.
# Packing the stashes and unpacking them stays outside, in the formats' own ops. A config is not a
# tensor, so the ops take the points in force as text (`points_text`) and the seeds of the
# randomness they draw: dropout's and, where a point rounds stochastically, the noise's.


def points_text(cfg: QuantConfig) -> str:
    """The points in force as the ops' argument: ``"<format> <rounding>"`` for q0..q3, by ``;``."""
    return ";".join(f"{cfg.format(p).spec} {cfg.rounding[p]}" for p in POINTS)


@functools.lru_cache(maxsize=64)
def _parsed_points(text: str) -> tuple[tuple[Format, str], ...]:
    return tuple((parse_format(fmt), rounding) for fmt, rounding in
                 (point.split() for point in text.split(";")))  # fmt: skip


def _points_of(text: str, noise_seed: int, device) -> tuple[_Point, ...]:
    """q0..q3 of ``points_text``; the stochastic ones draw from one generator seeded with
    ``noise_seed``, as a config's stochastic points share its generator."""
    parsed = _parsed_points(text)
    generator = None
    if any(rounding == "stochastic" for _, rounding in parsed):
        generator = torch.Generator(device=device).manual_seed(noise_seed)
    return tuple(_Point(fmt, rounding, generator if rounding == "stochastic" else None)
                 for fmt, rounding in parsed)  # fmt: skip


def _noise_seed(cfg: QuantConfig, device) -> int:
    """A seed for a kernel's stochastic rounding, drawn from the config's generator (so a resumed
    run draws the same), or 0 where every point rounds to nearest."""
    if all(rounding == "nearest" for rounding in cfg.rounding.values()):
        return 0
    generator = cfg.generator(device)
    return int(torch.randint(0, 2**62, (), generator=generator, device=generator.device))


@torch.library.custom_op("dsq::attention_forward", mutates_args=("q0",))
def attention_forward(
    q0: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, mask: torch.Tensor | None,
    key_padding: torch.Tensor | None, points: str, gemm_unit: str, scaling: float, causal: bool,
    dropout: float, dropout_seed: int, noise_seed: int, tile_rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The tiled forward pass (module docstring) from ``q0(Q)``, ``q0(K)`` and ``q0(V)``:
    ``(O [B, H, N, e], amax)``, ``amax`` Pd's largest magnitude in float32 where a whole-tensor
    scale needs it for the backward pass, else 0. ``q0`` is the kernel's to use: a folded
    scaling multiplies it in place. ``tile_rows`` 0 lets the kernel choose."""
    call = _Call(q0, k0, v0, _points_of(points, noise_seed, q0.device), gemm_unit, scaling, mask,
                 causal, key_padding, dropout, dropout_seed, tile_rows or None)  # fmt: skip
    triton_kernels = _triton_kernels(call, q0, k0, v0)
    if triton_kernels is not None:
        out, amax = triton_kernels.forward(
            call.scaled(q0, (k0, v0)), k0, v0, mask, key_padding, call.points, scaling,
            call.causal, call.folded,
        )  # fmt: skip
        units.count("matmul.forward", "fp32", 2)  # S and O, in float32 whatever the plans say
        amax = torch.zeros((), device=q0.device) if amax is None else amax
        return out, amax.to(torch.float32)
    out = _forward(call, q0, k0, v0)
    amax = call.amax_pd if call.amax_pd is not None else torch.zeros((), device=q0.device)
    return out, amax.to(torch.float32)


@attention_forward.register_fake
def _attention_forward_fake(q0, k0, v0, *_):
    b, heads, n, _ = q0.shape
    return q0.new_empty(b, heads, n, v0.shape[-1]), q0.new_empty((), dtype=torch.float32)


@torch.library.custom_op("dsq::attention_backward", mutates_args=("q0",))
def attention_backward(
    d_out: torch.Tensor, q0: torch.Tensor, k0: torch.Tensor, q1: torch.Tensor, k1: torch.Tensor,
    v1: torch.Tensor, amax_pd: torch.Tensor | None, mask: torch.Tensor | None,
    key_padding: torch.Tensor | None, points: str, gemm_unit: str, scaling: float, causal: bool,
    dropout: float, dropout_seed: int, noise_seed: int, tile_rows: int,
    amax_out: torch.Tensor | None = None, amax_dz: torch.Tensor | None = None,
    first_sequence: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The tiled backward pass (module docstring): ``(dQ, dK, dV)`` from the incoming gradient
    ``d_out`` and the saved operands, ``q0`` and ``k0`` as the forward pass had them (``q0``
    unscaled; the kernel's to use, as there), ``q1(Q)``, ``q1(K)``, ``q1(V)`` unpacked, and the
    forward's ``amax`` (None where q1 does not scale the whole tensor); the other arguments are
    the forward's, but for the noise's seed. A call on one group of the batch's sequences
    (`stash_groups`) is given the batch's largest magnitude of dO, and of dZ where q3 scales the
    whole tensor (`attention_score_gradient_magnitude` finds it), and its first sequence's place
    in the batch; it runs the torch kernel."""
    call = _Call(q0, k0, v1, _points_of(points, noise_seed, q0.device), gemm_unit, scaling, mask,
                 causal, key_padding, dropout, dropout_seed, tile_rows or None,
                 first_sequence)  # fmt: skip
    call.amax_pd = None if amax_pd is None else amax_pd.to(q0.dtype)
    call.amax_out = None if amax_out is None else amax_out.to(q0.dtype)
    call.amax_dz = None if amax_dz is None else amax_dz.to(q0.dtype)
    # a group's call (its arguments given) runs the torch kernel; the Triton kernels take a batch
    grouped = first_sequence or amax_out is not None or amax_dz is not None
    triton_kernels = None if grouped else _triton_kernels(call, q0, k0, v1, d_out, q1, k1)
    if triton_kernels is not None:
        units.count("matmul.da", "fp32", 2)  # dPd and dQ, in float32 as the forward's
        units.count("matmul.db", "fp32", 2)  # dV and dK
        g_out, g2_out = _whole_incoming_gradient(call, d_out)
        keep = (d_out, g_out, k0, q1, k1, v1)
        return triton_kernels.backward(
            g_out, call.scaled(g2_out, keep), call.scaled(q0, keep), k0, q1, k1, v1,
            call.amax_pd, mask, key_padding, call.points, scaling, call.causal, call.folded,
        )  # fmt: skip
    return _backward(call, d_out, q0, k0, q1, k1, v1)


@attention_backward.register_fake
def _attention_backward_fake(d_out, q0, k0, q1, k1, v1, *_):
    b, kv_heads, m, d = k0.shape
    dk = q0.new_empty(b, kv_heads, d, m).transpose(-1, -2)
    return torch.empty_like(q0), dk, q0.new_empty(b, kv_heads, m, v1.shape[-1])


@torch.library.custom_op("dsq::attention_score_gradient_magnitude", mutates_args=("q0",))
def attention_score_gradient_magnitude(
    d_out: torch.Tensor, q0: torch.Tensor, k0: torch.Tensor, v1: torch.Tensor,
    amax_out: torch.Tensor | None, mask: torch.Tensor | None, key_padding: torch.Tensor | None,
    points: str, gemm_unit: str, scaling: float, causal: bool, dropout: float, dropout_seed: int,
    tile_rows: int, first_sequence: int,
) -> torch.Tensor:  # fmt: skip
    """The largest magnitude of dZ (float32) over one group of a batch's sequences: the pass that
    gives a whole-tensor q3 its scale when the backward pass runs a group at a time
    (`stash_groups`), with the arguments of `attention_backward` for that group. Every point
    rounds to nearest there, so no noise is drawn."""
    call = _Call(q0, k0, v1, _points_of(points, 0, q0.device), gemm_unit, scaling, mask, causal,
                 key_padding, dropout, dropout_seed, tile_rows or None, first_sequence)  # fmt: skip
    call.amax_out = None if amax_out is None else amax_out.to(q0.dtype)
    g_out_of, whole = _incoming_gradient(call, d_out, (k0, v1))
    d_scores_of = _tile_gradients(call, q0, k0, v1, (d_out, k0, v1, *whole))
    return _largest_score_gradient(call, q0, g_out_of, d_scores_of).to(torch.float32)


@attention_score_gradient_magnitude.register_fake
def _attention_score_gradient_magnitude_fake(d_out, q0, *_):
    return q0.new_empty((), dtype=torch.float32)


def _triton_kernels(call: _Call, q0, k0, v0, *others):
    """The Triton kernels' host module (``attention_triton.py``) where the formats' quantizers
    run ``q0`` on the triton backend and the kernels hold this call, else None: the torch
    kernel runs, and a line logged once says why where the backend is triton."""
    if backends.backend_name(q0) != "triton":
        return None
    from dsq.formats import attention_triton

    reason = attention_triton.unsupported_reason(q0, k0, v0, call.points, call.dropout, *others)
    if reason is not None:
        # the run is slower, not different
        warn_once(LOGGER, f"dsq: attention runs its torch kernel on the triton backend here: the "
                       f"Triton kernels do not hold {reason}")  # fmt: skip
        return None
    return attention_triton


def _owned(x: torch.Tensor, others) -> torch.Tensor:
    """``x``, or a copy where it shares memory with one of ``others`` (a caller's input, a
    stash): the kernels scale their ``q0`` in place."""
    return x.clone() if any(_shares_memory(x, t) for t in others) else x


def stash_groups(q: torch.Tensor, k: torch.Tensor, points, tile_rows=None) -> list[slice]:
    """The groups of a batch's sequences whose stashes are packed, unpacked and run through the
    backward pass one group at a time (docs/dsq.md, "Attention in tiles"): a tile's sequences,
    so one sequence once a sequence's ``heads x N x M`` passes half of `TILE_ELEMENTS` (from 368
    tokens a sequence at 8 heads), and the whole batch where many fit one tile.

    The batch is one group where a group's values could differ from the whole batch's: a format
    whose scale spans the tensor at q0, q1 or q2 (its stash or its quantized operand would take
    the group's largest magnitude; q3's is given the batch's, `attention_score_gradient_magnitude`),
    a stochastic rounding (its noise is drawn for the whole tensor), or the Triton backend, whose
    kernels take the whole batch; and under torch.compile, whose graph the backward pass's test
    of dO for a NaN (`DSQAttentionFunction.backward`) would break."""
    b = q.shape[0]
    formats = [p.fmt for p in points]
    if (b == 0 or any(map(_whole_scale, points[:3]))
            or any(p.rounding != "nearest" for p in points)
            or backends.backend_name(q) == "triton" or torch.compiler.is_compiling()):  # fmt: skip
        return [slice(0, b)]
    # the kernels' tiles: tile_rows 0 or None lets them choose
    seqs = _Tiles(b, q.shape[1], q.shape[2], k.shape[2], formats, False, tile_rows or None).seqs
    return [slice(b0, min(b0 + seqs, b)) for b0 in range(0, b, seqs)]


def _group_arguments(arguments, group: slice, batch: int):
    """The kernels' arguments for one group of sequences: a mask with a batch axis and the key
    padding cut to the group's sequences."""
    mask, key_padding, *rest = arguments
    if mask is not None and mask.dim() == 4 and mask.shape[0] == batch:
        mask = mask[group]
    key_padding = None if key_padding is None else key_padding[group]
    return (mask, key_padding, *rest)


class DSQAttentionFunction(torch.autograd.Function):
    """`dsq_attention` with a backward pass (module docstring): packs and unpacks the stashes
    around `attention_forward` and `attention_backward`, a group of sequences at a time
    (`stash_groups`)."""

    @staticmethod
    def forward(ctx, q, k, v, cfg, scaling, mask, causal, key_padding, dropout, tile_rows):
        points = _points(cfg, q.device)
        f0, f1 = points[0], points[1]
        groups = stash_groups(q, k, points, tile_rows)
        packs = [[f0.pack(q[g], -1), f0.pack(k[g], -1)] for g in groups]
        if len(groups) == 1:  # q0 and k0 from their stashes: one pass over q and k
            q_packed, k_packed = packs[0]
            q0 = _owned(q_packed.unpack(), (q, *q_packed.payload.values()))
            k0 = k_packed.unpack()
        else:
            q0, k0 = _owned(f0.quantize(q, -1), (q,)), f0.quantize(k, -1)
        v0 = f0.quantize(v, -2)
        dropout_seed = int(torch.randint(0, 2**62, (), dtype=torch.int64)) if dropout > 0 else 0
        # every argument of the two kernels but the tensors and the noise's seed
        ctx.arguments = (mask, key_padding, points_text(cfg), cfg.gemm_unit, scaling, causal,
                         dropout, dropout_seed, tile_rows or 0)  # fmt: skip
        out, amax_pd = torch.ops.dsq.attention_forward(
            q0, k0, v0, *ctx.arguments[:-1], _noise_seed(cfg, q.device), ctx.arguments[-1]
        )
        ctx.amax_pd = amax_pd if _whole_scale(f1) else None  # the only use the backward has
        for g, group_packs in zip(groups, packs):
            group_packs += [f1.pack(q[g], -2), f1.pack(k[g], -2), f1.pack(v[g], -1)]
        ctx.cfg, ctx.groups, ctx.batch = cfg, groups, q.shape[0]
        ctx.whole_q3 = _whole_scale(points[3])  # the points of the forward pass, as the stashes
        ctx.headers, tensors = [], []
        for packed in (p for group_packs in packs for p in group_packs):
            header, payload = _stash_header(packed)  # as the other DSQ functions save theirs
            ctx.headers.append(header)
            tensors += payload
        for t in tensors:  # already in their formats: a stash_scope=all hook leaves them be
            t.dsq_held_as_is = True
        ctx.save_for_backward(*tensors)  # the masks stay with ctx.arguments, shared by every layer
        stash_bytes = sum(t.numel() * t.element_size() for t in tensors)
        b, h, n, d = q.shape
        m, e = k.shape[2], v.shape[-1]
        formats = [p.fmt for p in points]
        plans_qk = _plans(*formats, q.device, cfg.gemm_unit, n * d * m)
        plans_pv = _plans(*formats, q.device, cfg.gemm_unit, n * m * e)
        # the two products the explicit path notes, priced alike by the cost model
        accounting.note("matmul", b * h, n, d, m, cfg, stash_bytes, plans_qk)
        accounting.note("matmul", b * h, n, m, e, cfg, 0, plans_pv)
        return out

    @staticmethod
    @backward_outside_autocast
    def backward(ctx, d_out):
        saved = list(ctx.saved_tensors)
        saved_all = tuple(saved)
        packs = []  # per group: q0, k0, q1, k1, v1 packed
        for header in ctx.headers:
            count = len(header[-1])  # the payload's names
            packs.append(_stash_restore(header, saved[:count]))
            del saved[:count]
        packs = [packs[i : i + 5] for i in range(0, len(packs), 5)]
        noise_seed = _noise_seed(ctx.cfg, d_out.device)
        amax_out = None
        if len(ctx.groups) > 1:
            amax_out = finite_largest_magnitude(d_out)
        if amax_out is None:  # one group, or a NaN or an infinity a whole scale would spread
            q0, k0, q1, k1, v1 = (_joined(kind, ctx.groups) for kind in zip(*packs))
            dq, dk, dv = torch.ops.dsq.attention_backward(
                d_out, _owned(q0, saved_all), k0, q1, k1, v1, ctx.amax_pd, *ctx.arguments[:-1],
                noise_seed, ctx.arguments[-1],
            )  # fmt: skip
        else:
            dq, dk, dv = _backward_by_groups(ctx, d_out, packs, amax_out, saved_all)
        return dq, dk, dv, None, None, None, None, None, None, None


def _joined(packs, groups) -> torch.Tensor:
    """One stash's groups unpacked and joined along the batch."""
    if len(groups) == 1:
        return packs[0].unpack()
    return torch.cat([packed.unpack() for packed in packs])


def _backward_by_groups(ctx, d_out, packs, amax_out, saved_all):
    """(dQ, dK, dV) a group of sequences at a time (`stash_groups`), each group's stashes
    unpacked in turn. Every group is given dO's largest magnitude (found finite on the whole dO,
    so no group tests its part again) and, where q3 scales the whole tensor, dZ's, found by a
    pass over the groups first."""
    arguments = [_group_arguments(ctx.arguments, g, ctx.batch) for g in ctx.groups]
    amax_dz = None
    if ctx.whole_q3:
        largest = []
        for g, (q0, k0, _, _, v1), args in zip(ctx.groups, packs, arguments):
            q0 = _owned(q0.unpack(), saved_all)
            largest.append(torch.ops.dsq.attention_score_gradient_magnitude(
                d_out[g], q0, k0.unpack(), v1.unpack(), amax_out, *args, g.start
            ))  # fmt: skip
        amax_dz = torch.stack(largest).amax()
    grads = None
    for g, group_packs, args in zip(ctx.groups, packs, arguments):
        q0, k0, q1, k1, v1 = (packed.unpack() for packed in group_packs)
        got = torch.ops.dsq.attention_backward(
            d_out[g], _owned(q0, saved_all), k0, q1, k1, v1, None, *args[:-1], 0, args[-1],
            amax_out, amax_dz, g.start,
        )  # fmt: skip
        del q0, k0, q1, k1, v1
        if grads is None:
            grads = [t.new_empty(ctx.batch, *t.shape[1:]) for t in got]
        for whole, part in zip(grads, got):
            whole[g] = part
        del got
    return grads


def _plans(f0, f1, f2, f3, device, unit, macs):
    """The units of a product's three GEMMs, as the explicit path plans them."""
    return tuple(units.plan(a, b, device, unit, macs) for a, b in ((f0, f0), (f2, f1), (f1, f3)))


@outside_autocast
def dsq_attention(q, k, v, cfg: QuantConfig, *, scaling: float | None = None, mask=None,
                  causal: bool = False, key_padding=None, dropout: float = 0.0,
                  training: bool = True, tile_rows: int | None = None) -> torch.Tensor:  # fmt: skip
    """Attention with DSQ's products, in tiles (module docstring): ``q [B, H, N, d]``,
    ``k [B, Hkv, M, d]``, ``v [B, Hkv, M, e]`` -> ``[B, H, N, e]``. ``mask``: None, boolean
    (True where a query may attend) or additive, broadcastable to ``[B, H, N, M]``; ``causal``
    applies the rule ``j <= i`` where there is no mask; ``key_padding [B, M]`` (True where a
    key is padding) forbids those keys besides; ``dropout`` applies only when
    ``training``. ``tile_rows`` overrides the rows of a tile (rounded to the blocks)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads cannot share {k.shape[1]} key/value heads")
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    dropout = dropout if training else 0.0
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return DSQAttentionFunction.apply(q, k, v, cfg, scaling, mask, causal, key_padding,
                                          dropout, tile_rows)  # fmt: skip
    f0 = _points(cfg, q.device)[0]
    q0 = _owned(f0.quantize(q, -1), (q,))
    k0, v0 = f0.quantize(k, -1), f0.quantize(v, -2)
    dropout_seed = int(torch.randint(0, 2**62, (), dtype=torch.int64)) if dropout > 0 else 0
    out, _ = torch.ops.dsq.attention_forward(
        q0, k0, v0, mask, key_padding, points_text(cfg), cfg.gemm_unit, scaling, causal, dropout,
        dropout_seed, _noise_seed(cfg, q.device), tile_rows or 0,
    )  # fmt: skip
    return out
