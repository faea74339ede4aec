"""A given kept set's CSR (pk.SamplingMask: token_ids [nnz], offsets [N + 1]) checked on the
device in one Triton launch and a sort, the rules of the CPU op ppo_kernels::check_kept_ids
(csrc/cpu/sampling.cpp) and of ppo_kernels/sampling.py check_replay's eager checks, which
take about 25 small torch ops on a device (the order and range tests, a repeat_interleave
of the row index, arange / mul / add for the sort keys, the sort, the comparison).

The rules (ppo_kernels/sampling.py CSR_RULES, in order): offsets start at 0 and end at
nnz; offsets never decrease; every id lies in [0, V); no id repeats within a row. One
program per row reads its offsets and its ids once: it flags the first three rules and
writes each id's sort key row * V + id; a repeat within a row is then two equal neighbours
among the sorted keys (torch.sort, O(nnz log nnz) on the device, any row length).

Outputs: flags int32 [3] for the first three rules, -1 where the rule holds and 0 where
it is broken (each the condition of one torch._assert_async as it is: a nonzero integer
is true); keys int64 [nnz]. Where the offsets are broken the keys of the rows they name
are undefined (the first two flags say so first).
"""

import torch
import triton
import triton.language as tl

from . import _config
from .logprobs import device_guard

# the ids a program reads at once; small under the interpreter, so that the test shapes
# span several blocks of a row
BLOCK_K = 4 if _config.INTERPRET else 128
FLAGS = 3


@triton.jit
def _csr_check_kernel(ids_ptr, offs_ptr, keys_ptr, flags_ptr, n, nnz, V,
                      BLOCK_K: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    s = tl.load(offs_ptr + r)
    e = tl.load(offs_ptr + r + 1)
    # (programs may write the same 0 at once: a flag only ever goes from -1 to 0)
    if ((r == 0) & (s != 0)) | ((r == n - 1) & (e != nnz)):
        tl.store(flags_ptr, 0)
    # (with both ends right, an offset below 0 or above nnz is a decrease somewhere)
    if (e < s) | (s < 0) | (e > nnz):
        tl.store(flags_ptr + 1, 0)
    lo = tl.minimum(tl.maximum(s, 0), nnz)
    hi = tl.minimum(tl.maximum(e, lo), nnz)
    outside = 0
    for k0 in range(lo, hi, BLOCK_K):
        idx = k0 + tl.arange(0, BLOCK_K)
        m = idx < hi
        v = tl.load(ids_ptr + idx, mask=m, other=0)
        outside += tl.sum((m & ((v < 0) | (v >= V))).to(tl.int32))
        tl.store(keys_ptr + idx, r * V + v, mask=m)
    if outside > 0:
        tl.store(flags_ptr + 2, 0)


def csr_check(ids, offsets, vocab):
    """(flags int32 [3], keys int64 [nnz]) of the CSR ids int64 [nnz], offsets int64
    [n + 1] (contiguous, on one device, n >= 1) over a vocabulary of vocab ids: a fill and
    one launch, no host read; the caller sorts the keys."""
    n, nnz = offsets.shape[0] - 1, ids.shape[0]
    flags = torch.full((FLAGS,), -1, dtype=torch.int32, device=ids.device)
    keys = torch.empty(nnz, dtype=torch.int64, device=ids.device)
    with device_guard(ids):
        _csr_check_kernel[(n,)](ids, offsets, keys, flags, n, nnz, vocab, BLOCK_K=BLOCK_K)
    return flags, keys
