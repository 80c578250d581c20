"""DSQ's tiled attention as Triton kernels (docs/dsq.md, "Attention in tiles"): the values of
``dsq/engine/attention.py``'s two passes, a program a tile.

One program holds one query head's ``BM`` query rows and walks the key tiles of ``BN`` keys,
forming each tile of the scores ``S = q0(Q) q0(K)^T`` (times the scaling where it is not folded
into ``q0(Q)``), the masks, and the probabilities ``P = exp(S - m) / l`` from each row's maximum
``m`` and sum ``l``, found by two earlier walks over the same tiles (the definition's softmax over
whole rows). Nothing ``N x M`` is stored.

* forward (`_forward_kernel`): ``O = sum over key tiles of q0(P) q0(V)``, ``q0`` with blocks
  along the keys; ``AMAX`` mode stores each program's largest ``|P|`` instead, for a format
  whose scale spans the tensor;
* backward, the rows (`_rows_kernel`): per query row the maximum, the sum and
  ``D = sum_j P dP`` (softmax's backward), then, in later launches, the largest ``|dZ|`` or
  ``|q3(dZ)|`` where a scale spans the tensor, and ``dQ = sum q2(q3(dZ)) q1(K)``; ``q3`` with
  blocks along the queries, ``q2`` along the keys;
* backward, the keys (`_keys_kernel`): one program a key/value head's ``BN`` keys walks every
  query tile of the head's group: ``dV += q1(P)^T q3(dO)``, ``dK += q3(dZ)^T q1(Q)``, ``q1``
  with blocks along the queries.

A point's format is given by constexprs (`point_constants`): its family (0: none, float32; 1:
BFP, ``B`` 0 for one block spanning the tensor, whose exponent comes from ``gbits``, the int32
bits of the tensor's largest magnitude; 2: MX), and the family's widths. Every quantizer here
rounds to nearest (even), as the formats' own Triton kernels (`dsq.kernels.bfp`, `dsq.kernels.mx`)
do, whose device helpers these call. The host's choice of what runs here is in
``dsq/formats/attention_triton.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .bfp import _abs_bits, _bfp_core, _bfp_value, _exp_code
from .mx import _element_round, _scale_by_pow2

NONE, BFP, MX = 0, 1, 2


# ============================================================================ quantizers on tiles
@triton.jit
def _bfp_of(x, maxbits, M: tl.constexpr, EMAX: tl.constexpr):
    """BFP values of ``x`` with the blocks' largest magnitudes ``maxbits`` (broadcast to it)."""
    code = _exp_code(maxbits, EMAX, 2 * EMAX + 1)
    finite = code != 2 * EMAX + 1
    q, k1, k2 = _bfp_core(tl.where(finite, x, 0.0), 0.0, code - EMAX, M, EMAX, False)
    return tl.where(finite, _bfp_value(q, k1, k2), float("nan"))


@triton.jit
def _mx_of(x, maxbits, M: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
           MAXN: tl.constexpr, INTEGER: tl.constexpr):  # fmt: skip
    """MX values of ``x`` with the blocks' largest magnitudes ``maxbits`` (broadcast to it)."""
    finite = maxbits < 0x7F800000
    s = tl.minimum(tl.maximum((maxbits >> 23) - 127 - EMAX, -127), 127)
    q = _element_round(_scale_by_pow2(tl.where(finite, x, 0.0), -s), M, EMIN, MAXN, INTEGER)
    return tl.where(finite, _scale_by_pow2(q, s), float("nan"))


@triton.jit
def _quant(x, gbits, R: tl.constexpr, C: tl.constexpr, ALONG_ROWS: tl.constexpr,
           FAM: tl.constexpr, B: tl.constexpr, M: tl.constexpr, EMIN: tl.constexpr,
           EMAX: tl.constexpr, MAXN: tl.constexpr, INTEGER: tl.constexpr):  # fmt: skip
    """A point's values of the tile ``x [R, C]``: blocks of ``B`` along the columns (the keys),
    or along the rows where ``ALONG_ROWS``. Elements outside the tensor are zeros here, which
    change no block's largest magnitude, so a partial block is quantized as its own."""
    if FAM == 0:
        out = x
    elif FAM == 1 and B == 0:
        out = _bfp_of(x, gbits, M, EMAX)
    elif ALONG_ROWS:
        x3 = tl.reshape(x, [R // B, B, C])
        maxbits = tl.max(_abs_bits(x3), axis=1)[:, None, :]
        if FAM == 1:
            out = tl.reshape(_bfp_of(x3, maxbits, M, EMAX), [R, C])
        else:
            out = tl.reshape(_mx_of(x3, maxbits, M, EMIN, EMAX, MAXN, INTEGER), [R, C])
    else:
        x3 = tl.reshape(x, [R, C // B, B])
        maxbits = tl.max(_abs_bits(x3), axis=2)[:, :, None]
        if FAM == 1:
            out = tl.reshape(_bfp_of(x3, maxbits, M, EMAX), [R, C])
        else:
            out = tl.reshape(_mx_of(x3, maxbits, M, EMIN, EMAX, MAXN, INTEGER), [R, C])
    return out


# ============================================================================ one tile's values
@triton.jit
def _load_keys(ptr, b, hk, keys, M, KVH, C: tl.constexpr):
    """Keys ``keys`` of head ``hk`` of a contiguous [B, KVH, M, C] tensor, zeros past M."""
    cc = tl.arange(0, C)
    return tl.load(ptr + ((b * KVH + hk) * M + keys[:, None]) * C + cc[None, :],
                   mask=(keys < M)[:, None], other=0.0)  # fmt: skip


@triton.jit
def _scores(q, k_ptr, b, h, hk, rows, keys, N, M, H, KVH, scaling, MASK, ms_b, ms_h, ms_n, ms_m,
            KP, D: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr,
            HAS_KP: tl.constexpr, FOLDED: tl.constexpr):  # fmt: skip
    """(S, allowed) of a tile [BM, BN]: ``q`` the rows' q0(Q) [BM, D] (scaled where FOLDED),
    keys from ``k_ptr`` (q0(K), [B, KVH, M, D] contiguous); forbidden places -inf in S."""
    kmask = keys < M
    k = _load_keys(k_ptr, b, hk, keys, M, KVH, D)
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    if not FOLDED:
        s = s * scaling
    allowed = (rows[:, None] < N) & kmask[None, :]
    if MASK_KIND != 0:
        mptr = MASK + b * ms_b + h * ms_h + rows[:, None] * ms_n + keys[None, :] * ms_m
        mval = tl.load(mptr, mask=allowed, other=0)
        if MASK_KIND == 1:  # boolean: nonzero where a query may attend
            allowed = allowed & (mval != 0)
        else:  # additive
            s = s + mval
    elif CAUSAL:
        allowed = allowed & (keys[None, :] <= rows[:, None])
    if HAS_KP:
        padded = tl.load(KP + b * M + keys, mask=kmask, other=1)
        allowed = allowed & (padded == 0)[None, :]
    return tl.where(allowed, s, float("-inf")), allowed


@triton.jit
def _row_stats_walk(q, k_ptr, b, h, hk, rows, N, M, H, KVH, scaling, MASK, ms_b, ms_h, ms_n,
                    ms_m, KP, key_end, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                    MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, HAS_KP: tl.constexpr,
                    FOLDED: tl.constexpr):  # fmt: skip
    """(m, l, empty) of the rows: the largest allowed score (0 for a row with none), the sum of
    exp(S - m), and whether a row has nothing to attend to: two walks, as a softmax over whole
    rows takes the maximum first."""
    m = tl.full([BM], float("-inf"), tl.float32)
    for start in range(0, key_end, BN):
        keys = start + tl.arange(0, BN)
        s, _ = _scores(q, k_ptr, b, h, hk, rows, keys, N, M, H, KVH, scaling, MASK, ms_b, ms_h,
                       ms_n, ms_m, KP, D, MASK_KIND, CAUSAL, HAS_KP, FOLDED)  # fmt: skip
        m = tl.maximum(m, tl.max(s, axis=1))
    empty = m == float("-inf")
    m = tl.where(empty, 0.0, m)
    lsum = tl.zeros([BM], tl.float32)
    for start in range(0, key_end, BN):
        keys = start + tl.arange(0, BN)
        s, _ = _scores(q, k_ptr, b, h, hk, rows, keys, N, M, H, KVH, scaling, MASK, ms_b, ms_h,
                       ms_n, ms_m, KP, D, MASK_KIND, CAUSAL, HAS_KP, FOLDED)  # fmt: skip
        lsum += tl.sum(tl.exp(s - m[:, None]), axis=1)
    return m, tl.where(empty, 1.0, lsum), empty


@triton.jit
def _finite_bits(x):
    """|x|'s bits where finite, else 0: a whole-tensor scale takes the largest finite magnitude."""
    bits = _abs_bits(x)
    return tl.where(bits < 0x7F800000, bits, 0)


@triton.jit
def _probs(s, m, lsum, empty):
    """P of a tile from its scores and its rows' statistics; 0 in a row with nothing allowed."""
    p = tl.math.div_rn(tl.exp(s - m[:, None]), lsum[:, None])
    return tl.where(empty[:, None], 0.0, p)


@triton.jit
def _key_end(q_start, BM: tl.constexpr, BN: tl.constexpr, M, CAUSAL: tl.constexpr):
    """The keys a query tile walks: under the causal rule none after its last row."""
    if CAUSAL:
        end = tl.minimum(M, q_start + BM)
    else:
        end = M
    return end


@triton.jit
def _load_rows(ptr, bh, rows, N, C: tl.constexpr):
    """Rows ``rows`` of head ``bh`` of a contiguous [B * heads, N, C] tensor, zeros past N."""
    cc = tl.arange(0, C)
    return tl.load(ptr + (bh * N + rows[:, None]) * C + cc[None, :], mask=(rows < N)[:, None],
                   other=0.0)  # fmt: skip


# ============================================================================ forward
@triton.jit
def _forward_kernel(Q, K, V, O, PART, G0, MASK, ms_b, ms_h, ms_n, ms_m, KP, N, M, H, KVH,
                    scaling, D: tl.constexpr, E: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr,
                    HAS_KP: tl.constexpr, FOLDED: tl.constexpr, AMAX: tl.constexpr,
                    F0: tl.constexpr, B0: tl.constexpr, M0: tl.constexpr, EMIN0: tl.constexpr,
                    EMAX0: tl.constexpr, MAXN0: tl.constexpr, INT0: tl.constexpr):  # fmt: skip
    bh, pid = tl.program_id(0), tl.program_id(1)  # heads on axis 0: no 65,535 limit
    b, h = bh // H, bh % H
    hk = h // (H // KVH)
    rows = pid * BM + tl.arange(0, BM)
    q = _load_rows(Q, bh, rows, N, D)
    key_end = _key_end(pid * BM, BM, BN, M, CAUSAL)
    m, lsum, empty = _row_stats_walk(q, K, b, h, hk, rows, N, M, H, KVH, scaling, MASK, ms_b,
                                     ms_h, ms_n, ms_m, KP, key_end, BM, BN, D, MASK_KIND,
                                     CAUSAL, HAS_KP, FOLDED)  # fmt: skip
    if AMAX:
        most = tl.zeros([BM], tl.int32)
    else:
        acc = tl.zeros([BM, E], tl.float32)
        gbits = tl.load(G0)
    ee = tl.arange(0, E)
    for start in range(0, key_end, BN):
        keys = start + tl.arange(0, BN)
        s, _ = _scores(q, K, b, h, hk, rows, keys, N, M, H, KVH, scaling, MASK, ms_b, ms_h,
                       ms_n, ms_m, KP, D, MASK_KIND, CAUSAL, HAS_KP, FOLDED)  # fmt: skip
        p = _probs(s, m, lsum, empty)
        if AMAX:
            most = tl.maximum(most, tl.max(_finite_bits(p), axis=1))
        else:
            p0 = _quant(p, gbits, BM, BN, False, F0, B0, M0, EMIN0, EMAX0, MAXN0, INT0)
            v = _load_keys(V, b, hk, keys, M, KVH, E)
            acc += tl.dot(p0, v, input_precision="ieee")
    if AMAX:
        tl.store(PART + bh * tl.num_programs(1) + pid, tl.max(most, axis=0))
    else:
        tl.store(O + (bh * N + rows[:, None]) * E + ee[None, :], acc, mask=(rows < N)[:, None])


# ============================================================================ backward
@triton.jit
def _score_grads(s, allowed, m, lsum, empty, D_row, go2, v1_ptr, b, hk, keys, M, KVH, scaling,
                 E: tl.constexpr, FOLDED: tl.constexpr):  # fmt: skip
    """(P, dZ) of a tile: dPd = q2(g_O) q1(V)^T, dS = P (dPd - D), dZ = dS * scaling (folded:
    the scaling is in q2(g_O) already)."""
    p = _probs(s, m, lsum, empty)
    v = _load_keys(v1_ptr, b, hk, keys, M, KVH, E)
    dp = tl.dot(go2, tl.trans(v), input_precision="ieee")
    dp = tl.where(allowed & ~empty[:, None], dp, 0.0)
    ds = p * (dp - D_row[:, None])
    if not FOLDED:
        ds = ds * scaling
    return p, dp, tl.where(allowed & ~empty[:, None], ds, 0.0)


@triton.jit
def _rows_kernel(Q, K, V1, GO2, K1, STATS, PART, DQ, G2, G3, MASK, ms_b, ms_h, ms_n, ms_m, KP,
                 N, M, H, KVH, scaling, D: tl.constexpr, E: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr,
                 HAS_KP: tl.constexpr, FOLDED: tl.constexpr, MODE: tl.constexpr,
                 F2: tl.constexpr, B2: tl.constexpr, M2: tl.constexpr, EMIN2: tl.constexpr,
                 EMAX2: tl.constexpr, MAXN2: tl.constexpr, INT2: tl.constexpr,
                 F3: tl.constexpr, B3: tl.constexpr, M3: tl.constexpr, EMIN3: tl.constexpr,
                 EMAX3: tl.constexpr, MAXN3: tl.constexpr, INT3: tl.constexpr):  # fmt: skip
    """MODE 0: the rows' statistics (m, l, D; empty rows l = 0) into STATS [B*H, 3, N];
    1: the largest |dZ| and 2: the largest |q3(dZ)| of the program into PART; 3: dQ."""
    bh, pid = tl.program_id(0), tl.program_id(1)  # heads on axis 0: no 65,535 limit
    b, h = bh // H, bh % H
    hk = h // (H // KVH)
    rows = pid * BM + tl.arange(0, BM)
    q = _load_rows(Q, bh, rows, N, D)
    go2 = _load_rows(GO2, bh, rows, N, E)
    key_end = _key_end(pid * BM, BM, BN, M, CAUSAL)
    stats = STATS + bh * 3 * N + rows
    if MODE == 0:
        m, lsum, empty = _row_stats_walk(q, K, b, h, hk, rows, N, M, H, KVH, scaling, MASK, ms_b,
                                         ms_h, ms_n, ms_m, KP, key_end, BM, BN, D, MASK_KIND,
                                         CAUSAL, HAS_KP, FOLDED)  # fmt: skip
        total = tl.zeros([BM], tl.float32)
        for start in range(0, key_end, BN):
            keys = start + tl.arange(0, BN)
            s, allowed = _scores(q, K, b, h, hk, rows, keys, N, M, H, KVH, scaling, MASK, ms_b,
                                 ms_h, ms_n, ms_m, KP, D, MASK_KIND, CAUSAL, HAS_KP,
                                 FOLDED)  # fmt: skip
            p = _probs(s, m, lsum, empty)
            v = _load_keys(V1, b, hk, keys, M, KVH, E)
            dp = tl.dot(go2, tl.trans(v), input_precision="ieee")
            total += tl.sum(p * tl.where(allowed, dp, 0.0), axis=1)
        inside = rows < N
        tl.store(stats, m, mask=inside)
        tl.store(stats + N, tl.where(empty, 0.0, lsum), mask=inside)
        tl.store(stats + 2 * N, total, mask=inside)
    else:
        m = tl.load(stats, mask=rows < N, other=0.0)
        lsum = tl.load(stats + N, mask=rows < N, other=0.0)
        D_row = tl.load(stats + 2 * N, mask=rows < N, other=0.0)
        empty = lsum == 0.0
        lsum = tl.where(empty, 1.0, lsum)
        g3 = tl.load(G3)
        g2 = tl.load(G2)
        most = tl.zeros([BM], tl.int32)
        dq = tl.zeros([BM, D], tl.float32)
        dd = tl.arange(0, D)
        for start in range(0, key_end, BN):
            keys = start + tl.arange(0, BN)
            s, allowed = _scores(q, K, b, h, hk, rows, keys, N, M, H, KVH, scaling, MASK, ms_b,
                                 ms_h, ms_n, ms_m, KP, D, MASK_KIND, CAUSAL, HAS_KP,
                                 FOLDED)  # fmt: skip
            _, _, dz = _score_grads(s, allowed, m, lsum, empty, D_row, go2, V1, b, hk, keys, M,
                                    KVH, scaling, E, FOLDED)  # fmt: skip
            if MODE == 1:
                most = tl.maximum(most, tl.max(_finite_bits(dz), axis=1))
            else:
                g = _quant(dz, g3, BM, BN, True, F3, B3, M3, EMIN3, EMAX3, MAXN3, INT3)
                if MODE == 2:
                    most = tl.maximum(most, tl.max(_finite_bits(g), axis=1))
                else:
                    gq = _quant(g, g2, BM, BN, False, F2, B2, M2, EMIN2, EMAX2, MAXN2, INT2)
                    k = _load_keys(K1, b, hk, keys, M, KVH, D)
                    dq += tl.dot(gq, k, input_precision="ieee")
        if MODE == 3:
            tl.store(DQ + (bh * N + rows[:, None]) * D + dd[None, :], dq,
                     mask=(rows < N)[:, None])  # fmt: skip
        else:
            tl.store(PART + bh * tl.num_programs(1) + pid, tl.max(most, axis=0))


@triton.jit
def _keys_kernel(Q, K, V1, GO, GO2, Q1, STATS, DK, DV, G1, G3, MASK, ms_b, ms_h, ms_n, ms_m, KP,
                 N, M, H, KVH, scaling, D: tl.constexpr, E: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr,
                 HAS_KP: tl.constexpr, FOLDED: tl.constexpr,
                 F1: tl.constexpr, B1: tl.constexpr, M1: tl.constexpr, EMIN1: tl.constexpr,
                 EMAX1: tl.constexpr, MAXN1: tl.constexpr, INT1: tl.constexpr,
                 F3: tl.constexpr, B3: tl.constexpr, M3: tl.constexpr, EMIN3: tl.constexpr,
                 EMAX3: tl.constexpr, MAXN3: tl.constexpr, INT3: tl.constexpr):  # fmt: skip
    """dK (into DK as [B, KVH, D, M]) and dV of one key/value head's BN keys, over every query
    tile of its group."""
    bhk, pid = tl.program_id(0), tl.program_id(1)
    b, hk = bhk // KVH, bhk % KVH
    rep = H // KVH
    keys = pid * BN + tl.arange(0, BN)
    g1, g3 = tl.load(G1), tl.load(G3)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, E], tl.float32)
    if CAUSAL:
        first = (pid * BN) // BM * BM  # the query tile holding the first key's row
    else:
        first = 0
    for r in range(0, rep):
        h = hk * rep + r
        bh = b * H + h
        for q_start in range(first, N, BM):
            rows = q_start + tl.arange(0, BM)
            q = _load_rows(Q, bh, rows, N, D)
            go2 = _load_rows(GO2, bh, rows, N, E)
            stats = STATS + bh * 3 * N + rows
            m = tl.load(stats, mask=rows < N, other=0.0)
            lsum = tl.load(stats + N, mask=rows < N, other=0.0)
            D_row = tl.load(stats + 2 * N, mask=rows < N, other=0.0)
            empty = lsum == 0.0
            lsum = tl.where(empty, 1.0, lsum)
            s, allowed = _scores(q, K, b, h, hk, rows, keys, N, M, H, KVH, scaling, MASK, ms_b,
                                 ms_h, ms_n, ms_m, KP, D, MASK_KIND, CAUSAL, HAS_KP,
                                 FOLDED)  # fmt: skip
            p, _, dz = _score_grads(s, allowed, m, lsum, empty, D_row, go2, V1, b, hk, keys, M,
                                    KVH, scaling, E, FOLDED)  # fmt: skip
            p1 = _quant(p, g1, BM, BN, True, F1, B1, M1, EMIN1, EMAX1, MAXN1, INT1)
            dv += tl.dot(tl.trans(p1), _load_rows(GO, bh, rows, N, E), input_precision="ieee")
            g = _quant(dz, g3, BM, BN, True, F3, B3, M3, EMIN3, EMAX3, MAXN3, INT3)
            dk += tl.dot(tl.trans(g), _load_rows(Q1, bh, rows, N, D), input_precision="ieee")
    inside = (keys < M)[:, None]
    dd, ee = tl.arange(0, D), tl.arange(0, E)
    # dK transposed, [B, KVH, D, M]: the torch kernel's layout, which the op's fake states
    tl.store(DK + (bhk * D + dd[None, :]) * M + keys[:, None], dk, mask=inside)
    tl.store(DV + (bhk * M + keys[:, None]) * E + ee[None, :], dv, mask=inside)
