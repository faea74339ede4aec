"""The re-derived kept sets' per-row threshold in one Triton launch (docs/SAMPLING.md): the
twin of csrc/cpu/sampling.cpp row_threshold, vLLM v1's sampler as a value threshold.

One program per row, no sort and no scratch memory: the k-th largest value (top-k) and
the top-p boundary are found by a radix select over the logits' bit patterns. A float's
bits, read as a signed integer with the lower bits flipped for negative values (and -0
taken as +0), order like the floats (`_keys`); offset to an unsigned number they are read
RADIX_BITS = 4 bits at a time from the top. Each pass sweeps the row once and histograms,
over the entries whose higher digits equal those chosen so far, the count (top-k) or the
mass (top-p) of each of the 16 values of the next digit, and keeps the digit whose bucket
holds the entry where the running total from the top reaches its target: at most 4
passes for bfloat16 / float16 logits, 8 for float32 (16 for float64), fewer when the
chosen bucket is down to one entry (one sweep then reads its key). The chosen digits are
the key of an entry of the row, so the threshold is that entry's value, exactly:

  min-p (min_p > 0): t = the smallest x with (x - max) / temperature >= log(min_p);
  top-k (0 < k < V): t = max(t, the k-th largest x) (ties with it are kept): the count
    from the top reaches k in its bucket;
  top-p (p < 1), over S = {x >= t}: with e = exp((x - max) / temperature), a value is kept
    iff the mass of S strictly above it is < p mass(S) (the top group always); the
    smallest kept value is the one where the mass from the top, itself included, reaches
    p mass(S) (or the smallest of S if the sum never does);
  the threshold is t's value, or -inf when no rule is on (or the row's max is not finite).

Counts are exact. The masses are float64 sums in block and bucket order (the CPU kernel
sums in sorted order): a row whose mass above an entry lies within float64 rounding of
p mass(S) can fall on the other side (as between the CPU kernel and the eager composite).
"""

import torch
import triton
import triton.language as tl

from . import _config
from .logprobs import device_guard

# The histogram of a block is a [BLOCK, 16] select: 256 entries over 4 warps keep it in
# registers (float64: 64 a thread).
BLOCK = 256
NUM_WARPS = 4
INTERPRET_BLOCK = 64  # under the interpreter: the test rows span blocks, the last partial
# Bits of a digit: 4 on a GPU (a [BLOCK, 16] histogram in registers); under the
# interpreter 8 (half the passes: its time is per operation, not per entry;
# tests/test_triton_threshold.py runs both).
RADIX_BITS = 8 if _config.INTERPRET else 4
KEY_MAX = tl.constexpr(2 ** 63 - 1)  # above every key (their magnitude is < 2 ** 63 - 2 ** 52)
KEY_BITS = {2: 16, 4: 32, 8: 64}  # the logits' item size -> the keys' bits


@triton.jit
def _keys(xs, KEY_BITS: tl.constexpr):
    """The ordered integer keys (int64) of a block of logits in their own dtype."""
    if KEY_BITS == 16:
        i = xs.to(tl.int16, bitcast=True).to(tl.int64)
        k = i ^ ((i >> 63) & 0x7FFF)
    elif KEY_BITS == 32:
        i = xs.to(tl.int32, bitcast=True).to(tl.int64)
        k = i ^ ((i >> 63) & 0x7FFFFFFF)
    else:
        i = xs.to(tl.int64, bitcast=True)
        k = i ^ ((i >> 63) & 0x7FFFFFFFFFFFFFFF)
    return tl.where(xs == 0, 0, k)


@triton.jit
def _value(key, dtype, KEY_BITS: tl.constexpr):
    """The float64 value of a key (the inverse of _keys)."""
    if KEY_BITS == 16:
        i = key ^ ((key >> 63) & 0x7FFF)
        return i.to(tl.int16).to(dtype, bitcast=True).to(tl.float64)
    elif KEY_BITS == 32:
        i = key ^ ((key >> 63) & 0x7FFFFFFF)
        return i.to(tl.int32).to(dtype, bitcast=True).to(tl.float64)
    else:
        i = key ^ ((key >> 63) & 0x7FFFFFFFFFFFFFFF)
        return i.to(tl.float64, bitcast=True)


@triton.jit
def _offset(KEY_BITS: tl.constexpr):
    """What a key is shifted by so that its bits read as an unsigned number of KEY_BITS
    bits, the same order (64 bits: -2 ** 63, the sign bit flipped by a wrapping add)."""
    if KEY_BITS == 64:
        return tl.full([], -9223372036854775807 - 1, tl.int64)
    else:
        return tl.full([], 1 << (KEY_BITS - 1), tl.int64)


@triton.jit
def _block(row, k0, V, KEY_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """(x as float64, keys, in-row flags) of block k0 of a row."""
    col = k0 + tl.arange(0, BLOCK)
    live = col < V
    xs = tl.load(row + col, mask=live, other=float("-inf"))
    return xs.to(tl.float64), _keys(xs, KEY_BITS), live


@triton.jit
def _in_bucket(u, prefix, shift, KEY_BITS: tl.constexpr, R: tl.constexpr):
    """Whether keys (offset: u) share prefix's digits above `shift` (all do when shift is
    the top digit's)."""
    high = tl.minimum(shift + R, KEY_BITS - 1)  # (a shift by the full width is undefined)
    return (shift + R >= KEY_BITS) | ((u >> high) == (prefix >> high))


@triton.jit
def _histogram(row, V, mx, inv, t_key, prefix, shift, MASS: tl.constexpr,
               KEY_BITS: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr):
    """One radix pass over the entries whose digits above `shift` equal prefix's (any entry
    of the row; MASS: those with key >= t_key): for each of the 2 ** R values of the digit at
    `shift`, the count and (MASS) the mass exp((x - max) / temperature)."""
    digits = tl.arange(0, 1 << R)
    c = tl.zeros([1 << R], tl.int64)
    m = tl.zeros([1 << R], tl.float64)
    for k0 in range(0, V, BLOCK):
        x, key, live = _block(row, k0, V, KEY_BITS, BLOCK)
        u = key + _offset(KEY_BITS)
        act = live & _in_bucket(u, prefix, shift, KEY_BITS, R)
        if MASS:
            act = act & (key >= t_key)
        hit = ((u >> shift) & ((1 << R) - 1))[:, None] == digits[None, :]
        c += tl.sum((hit & act[:, None]).to(tl.int64), 0)
        if MASS:
            w = tl.where(act, tl.exp((x - mx) * inv), 0.0)
            m += tl.sum(tl.where(hit, w[:, None], 0.0), 0)
    return c, m


@triton.jit
def _pick(h, c, need, R: tl.constexpr):
    """The digit whose bucket holds the entry where the running total h from the largest
    digit down reaches need (> 0), or the smallest nonempty digit (counts c) when it never
    does; and the total of the digits above it."""
    digits = tl.arange(0, 1 << R)
    at_or_above = tl.sum(tl.where(digits[None, :] >= digits[:, None], h[None, :], 0), 1)
    d = tl.max(tl.where(at_or_above >= need, digits, -1), 0)
    lowest = tl.min(tl.where(c > 0, digits, 1 << R), 0)
    d = tl.where(d >= 0, d, lowest)
    return d, tl.sum(tl.where(digits > d, h, 0), 0)


@triton.jit
def _select(row, V, mx, inv, t_key, need, MASS: tl.constexpr, KEY_BITS: tl.constexpr,
            R: tl.constexpr, BLOCK: tl.constexpr):
    """The key of the entry where the running total from the top (counts; MASS: the masses
    of the entries with key >= t_key, need a fraction of their total) reaches need. The
    passes stop early once the chosen bucket holds a single entry: one more sweep reads
    its key."""
    digits = tl.arange(0, 1 << R)
    prefix = tl.zeros([], tl.int64)
    if MASS:
        above = tl.zeros([], tl.float64)
        target = tl.zeros([], tl.float64)
    else:
        above = tl.zeros([], tl.int64)
        target = need.to(tl.int64)
    i = 0
    n = tl.zeros([], tl.int64) + V  # entries in the chosen bucket
    while (i < KEY_BITS // R) & (n > 1):
        shift = KEY_BITS - R - R * i
        c, m = _histogram(row, V, mx, inv, t_key, prefix, shift, MASS, KEY_BITS, R, BLOCK)
        if MASS:
            if i == 0:  # the first pass sees all of S: its total is mass(S)
                target = need * tl.sum(m, 0)
            d, more = _pick(m, c, target - above, R)
        else:
            d, more = _pick(c, c, target - above, R)
        above += more
        n = tl.sum(tl.where(digits == d, c, 0), 0)
        prefix = prefix | (d.to(tl.int64) << shift)
        i += 1
    key = prefix - _offset(KEY_BITS)
    if i < KEY_BITS // R:  # a single entry left: its key
        key = tl.full([], -KEY_MAX, tl.int64)
        for k0 in range(0, V, BLOCK):
            x, k, live = _block(row, k0, V, KEY_BITS, BLOCK)
            act = live & _in_bucket(k + _offset(KEY_BITS), prefix, KEY_BITS - R - R * i,
                                    KEY_BITS, R)
            if MASS:
                act = act & (k >= t_key)
            key = tl.maximum(key, tl.max(tl.where(act, k, -KEY_MAX), 0))
    return key


@triton.jit
def _threshold_kernel(
    logits_ptr, stride_lb, stride_lt, mask_ptr, topk_ptr, topp_ptr, minp_ptr, temps_ptr,
    out_ptr, T, V, temperature: tl.float64,
    HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_MINP: tl.constexpr,
    ROW_TEMP: tl.constexpr, KEY_BITS: tl.constexpr, RADIX_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    row = logits_ptr + (r // T) * stride_lb + (r % T) * stride_lt
    t_val = tl.full([], float("-inf"), tl.float64)
    if tl.load(mask_ptr + r):
        if ROW_TEMP:
            inv = 1.0 / tl.load(temps_ptr + r).to(tl.float64)
        else:
            inv = 1.0 / temperature
        # the row's max (float64), the largest and the smallest key
        mx = tl.full([], float("-inf"), tl.float64)
        kmin = tl.full([], KEY_MAX, tl.int64)
        k_max = tl.full([], -KEY_MAX, tl.int64)
        for k0 in range(0, V, BLOCK):
            x, key, live = _block(row, k0, V, KEY_BITS, BLOCK)
            mx = tl.maximum(mx, tl.max(tl.where(live, x, float("-inf")), 0))
            kmin = tl.minimum(kmin, tl.min(tl.where(live, key, KEY_MAX), 0))
            k_max = tl.maximum(k_max, tl.max(tl.where(live, key, -KEY_MAX), 0))
        if (mx > float("-inf")) & (mx < float("inf")):
            on = tl.zeros([], tl.int32)
            t_key = kmin  # every entry is >= t: nothing cut yet
            if HAS_MINP:
                min_p = tl.load(minp_ptr + r)
                if min_p > 0.0:
                    on += 1
                    lo = tl.log(min_p)
                    t_key = k_max
                    for k0 in range(0, V, BLOCK):
                        x, key, live = _block(row, k0, V, KEY_BITS, BLOCK)
                        ok = live & ((x - mx) * inv >= lo)
                        t_key = tl.minimum(t_key, tl.min(tl.where(ok, key, k_max), 0))
            if HAS_K:
                k = tl.load(topk_ptr + r)
                if (k > 0) & (k < V):
                    on += 1
                    kth = _select(row, V, mx, inv, t_key, k, False, KEY_BITS, RADIX_BITS,
                                  BLOCK)
                    t_key = tl.maximum(t_key, kth)
            if HAS_P:
                p = tl.load(topp_ptr + r)
                if p < 1.0:
                    on += 1
                    t_key = _select(row, V, mx, inv, t_key, p, True, KEY_BITS, RADIX_BITS,
                                    BLOCK)
            if on > 0:
                t_val = _value(t_key, logits_ptr.dtype.element_ty, KEY_BITS)
    tl.store(out_ptr + r, t_val)


def sampling_threshold(logits, mask, temperature, top_k, top_p, min_p, temperatures=None):
    """The per-row threshold (float64 [B, T], -inf = keep all) of the re-derived kept sets,
    in one launch. logits [B, Tl >= T, V]; top_k int64, top_p / min_p float64 [B, T] or
    None; temperatures the optional per-row [B, T] (else the number temperature)."""
    B, T = mask.shape
    V = logits.shape[2]
    for name, x, dtype in (("top_k", top_k, torch.int64), ("top_p", top_p, torch.float64),
                           ("min_p", min_p, torch.float64)):
        if x is not None and (x.dtype != dtype or x.numel() != B * T):
            raise ValueError(f"{name}: expected {str(dtype)[6:]} [B, T]")
    out = torch.empty(B, T, dtype=torch.float64, device=logits.device)
    if logits.stride(2) != 1:
        logits = logits.contiguous()
    dummy = torch.zeros(1, dtype=torch.float64, device=logits.device)

    def given(x):
        return dummy if x is None else x.contiguous()

    if B * T:
        with device_guard(logits):
            _config.wrap(_threshold_kernel)[(B * T,)](
                logits, logits.stride(0), logits.stride(1), mask.contiguous(), given(top_k),
                given(top_p), given(min_p), given(temperatures), out, T, V,
                float(temperature), HAS_K=top_k is not None, HAS_P=top_p is not None,
                HAS_MINP=min_p is not None, ROW_TEMP=temperatures is not None,
                KEY_BITS=KEY_BITS[logits.element_size()], RADIX_BITS=RADIX_BITS,
                BLOCK=INTERPRET_BLOCK if _config.INTERPRET else BLOCK, num_warps=NUM_WARPS)
    return out
