"""The compile backend: a format family's kernels written as float32 torch functions, fused by
torch.compile (CPU), and what they share.

This module holds what only the backend knows, and no family's kernels: whether it runs here
(`unavailable_reason`), how a kernel function runs compiled (`run`: one compiled variant per
function, its leading dimensions dynamic, the recompile limit raised while it compiles), the
float32 rounding every family's kernels share (`rounded`, nearest or stochastic), and the second
stage of packing, flat integer codes to a bit stream and back (`code_stream`, `unpack_codes`,
byte for byte ``exact.pack_bits``' layout, docs/formats.md). The families' kernels for this
backend are in their own modules, declared with their family (``bfp_compile.py``,
``fixed_compile.py``); the c backend runs them for every call its C kernels do not hold.

Index arithmetic never divides by a symbolic size (that costs 3x in unpack).
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import sys

import torch

from .memo import memo

_RECOMPILE_LIMIT = 256  # one compiled variant per format, row length and noise on/off


def rounded(v: torch.Tensor, u: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    if u is None:
        return torch.round(v)  # half to even
    t = torch.trunc(v)
    g = v - t
    up = (g >= 0) & (g >= 1 - u)
    # (u == 0) & (x < 0) & (t == 0): v underflowed to -0.0; exactly, floor(tiny negative) = -1
    down = ((g < 0) & (u < -g)) | ((u == 0) & (x < 0) & (t == 0))
    q = t + up.to(torch.float32) - down.to(torch.float32)
    return torch.copysign(q, v)


def code_dtype(width: int) -> torch.dtype:
    """Narrowest integer dtype holding a ``width``-bit code (int32 wraps for width 32)."""
    return torch.uint8 if width <= 8 else torch.int16 if width <= 16 else torch.int32


def _word_plan(width: int) -> tuple[int, int] | None:
    """For unpacking: ``g`` codes per int64 word when whole bytes fit: (g, bytes used), or None.

    On a little-endian machine the next ``g * width / 8`` bytes of the stream, zero-extended to 8,
    are one int64 word from which ``(word >> (width * arange(g))) & mask`` extracts the codes in
    one vectorised step. Odd widths above 8 need more than 64 bits per byte-aligned group and use
    the byte gather instead.
    """
    if sys.byteorder != "little":
        return None
    per_group = 8 // math.gcd(width, 8)
    if per_group * width > 64:
        return None
    g = per_group * (64 // (per_group * width))
    return g, g * width // 8


def code_stream(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Stage 2 of pack, on the host: the byte stream of flat integer ``codes`` (`code_dtype`).

    Widths 8, 16 and 32 are already the stream (a view, little-endian); other one-byte codes are
    read eight at a time as int64 words (`_pack_bytes_fn`); the others run the compiled byte
    gather over the compact codes, padded to whole groups first.
    """
    # a flat slice such as codes[:, :1].reshape(-1) can be a strided view: the byte view needs
    # unit stride, and a strided stream would hold on to the whole padded buffer of codes
    codes = codes.contiguous()
    if width in (8, 16, 32) and sys.byteorder == "little":
        return codes.view(torch.uint8)
    count = codes.shape[0]
    if width < 8 and codes.dtype == torch.uint8 and sys.byteorder == "little":
        if count % 8:
            codes = torch.nn.functional.pad(codes, (0, 8 - count % 8))
        elif codes.storage_offset() % 8:  # a slice: an int64 view needs an 8-byte offset
            codes = codes.clone()
        words = codes.view(torch.int64)
        stream = run(_pack_bytes_fn, words, width, dynamic_dims=((words, 0),))
        return stream.reshape(-1).view(torch.uint8)[: (count * width + 7) // 8]
    per_group, _ = _group(width)
    if count % per_group:
        codes = torch.nn.functional.pad(codes, (0, per_group - count % per_group))
    groups = codes.reshape(-1, per_group)
    stream = run(_pack_groups, groups, width, dynamic_dims=((groups, 0),))
    return stream.reshape(-1)[: (count * width + 7) // 8]


def _unpack_input(stream: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """On the host: what ``_unpack_codes_fn`` reads: int64 words [G] (``_word_plan``), or the
    stream cut into byte groups [G, bytes per group] (``_group``), zero-padded at the end."""
    plan = _word_plan(width)
    if plan is None:
        per_group, group_bytes = _group(width)
        groups = -(-count // per_group)
        if stream.numel() != groups * group_bytes:
            stream = torch.nn.functional.pad(stream, (0, groups * group_bytes - stream.numel()))
        return stream.reshape(groups, group_bytes)
    g, used = plan
    groups = -(-count // g)
    if used == 8 and stream.numel() == groups * 8:
        return stream.view(torch.int64)  # already whole words: no copy
    words = torch.zeros(groups, 8, dtype=torch.uint8, device=stream.device)
    if used == 8:
        words.reshape(-1)[: stream.numel()].copy_(stream)
    else:
        compact = torch.zeros(groups * used, dtype=torch.uint8, device=stream.device)
        compact[: stream.numel()].copy_(stream)
        words[:, :used].copy_(compact.reshape(groups, used))
    return words.view(torch.int64).reshape(groups)


def _unpack_codes_fn(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Stage 1 of unpack: codes [G, per group] from ``_unpack_input``'s words or byte groups,
    in a narrow dtype (the decode stage reads them back)."""
    plan = _word_plan(width)
    mask = (1 << width) - 1
    if plan is None:
        per_group, group_bytes = _group(width)
        stream = packed.to(torch.int64)
        out = []
        for i in range(per_group):
            code = None
            for j in range(group_bytes):
                shift = 8 * j - width * i  # where byte j's bit 0 lands relative to code i's bit 0
                if shift >= width or shift + 8 <= 0:
                    continue
                part = stream[:, j] << shift if shift >= 0 else stream[:, j] >> -shift
                code = part if code is None else code | part
            out.append(code & mask)
        codes = torch.stack(out, dim=1)
    else:
        g, _ = plan
        shifts = torch.arange(g, device=packed.device, dtype=torch.int64) * width
        codes = (packed[:, None] >> shifts) & mask
    dtype = torch.uint8 if width <= 8 else torch.int32 if width <= 31 else torch.int64
    return codes.to(dtype)


def unpack_codes(stream: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The first ``count`` codes of a stream (two compiled-friendly steps, no symbolic sizes)."""
    if width == 8:  # one code per byte, in order: the stream is the codes (no pass, no copy)
        if stream.numel() < count:
            raise ValueError(f"a stream of {stream.numel()} bytes holds fewer than {count} codes")
        return stream[:count]
    packed = _unpack_input(stream, width, count)
    codes = run(_unpack_codes_fn, packed, width, dynamic_dims=((packed, 0),))
    return codes.reshape(-1)[:count]


def _group(width: int) -> tuple[int, int]:
    """Smallest run of codes that fills whole bytes: (codes per group, bytes per group)."""
    codes = 8 // math.gcd(width, 8)
    return codes, codes * width // 8


def _pack_bytes_fn(words: torch.Tensor, width: int) -> torch.Tensor:
    """exact.pack_bits for codes of ``width`` < 8 bits held one per byte, read as int64
    ``words`` [G] of 8 codes each (little-endian): each word's 8 * width bits, as int32 [G]
    for width 4, uint8 [G] for width 1, else [G, width] bytes. Whole words keep every load
    contiguous and vectorised: 1.4x (width 6) to 4x (width 4) faster than `_pack_groups`'
    strided per-code reads (docs/benchmarks.md), except at width 2, where both run alike."""
    mask = (1 << width) - 1
    bits = None
    for i in range(8):
        part = ((words >> (8 * i)) & mask) << (width * i)
        bits = part if bits is None else bits | part
    if width == 4:
        return bits.to(torch.int32)
    if width == 1:
        return bits.to(torch.uint8)
    # int16 for width 2 would be one store, but inductor's vectorised int16 store is slow
    return torch.stack([((bits >> (8 * j)) & 0xFF).to(torch.uint8) for j in range(width)], 1)


def _pack_groups(codes: torch.Tensor, width: int) -> torch.Tensor:
    """exact.pack_bits for codes [G, per_group]: each output byte ORs the codes overlapping
    it (shifts fixed at trace time). Returns [G, bytes per group] uint8."""
    per_group, group_bytes = _group(width)
    work = torch.int32 if width <= 24 else torch.int64  # shifted codes stay below 2^(width+8)
    codes = codes.to(work) & ((1 << width) - 1)  # narrow dtypes may have wrapped
    out = []
    for j in range(group_bytes):
        byte = None
        for i in range(per_group):
            shift = width * i - 8 * j  # where code i's bit 0 lands relative to byte j's bit 0
            if shift >= 8 or shift + width <= 0:
                continue  # no overlap
            part = codes[:, i] << shift if shift >= 0 else codes[:, i] >> -shift
            byte = part if byte is None else byte | part
        out.append((byte & 0xFF).to(torch.uint8))
    return torch.stack(out, dim=1)


@functools.cache
def compiled(fn):
    return torch.compile(fn, dynamic=False, fullgraph=True)


def run(fn, *args, dynamic_dims=()):
    """Run ``fn`` compiled, with the leading dims of its tensor arguments marked dynamic."""
    for tensor, dim in dynamic_dims:
        torch._dynamo.maybe_mark_dynamic(tensor, dim)
    # The limit matters only when a call compiles. Set as a plain attribute and put back:
    # config.patch's context manager costs about 20 us, a third of a small call.
    config = torch._dynamo.config
    prior = config.recompile_limit
    if prior >= _RECOMPILE_LIMIT:
        return compiled(fn)(*args)
    config.recompile_limit = _RECOMPILE_LIMIT
    try:
        return compiled(fn)(*args)
    finally:
        config.recompile_limit = prior


@memo
def unavailable_reason(device_type: str) -> str | None:
    """Why this backend cannot run tensors of ``device_type`` here, or None when it can (kept: a
    backend named by a call or ``DSQ_BACKEND`` is asked at every quantizer call, and the import
    and compiler search below would break a compiled graph each time)."""
    if device_type != "cpu":
        return f"its kernels are for CPU tensors (got {device_type})"
    try:
        import torch._dynamo  # noqa: F401
    except Exception as err:  # pragma: no cover - depends on the torch build
        return f"torch.compile is unavailable ({err})"
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python"
    if shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("gcc") is None:
        return "no C++ compiler for torch.compile's CPU backend"
    return None
