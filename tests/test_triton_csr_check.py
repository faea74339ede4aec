"""A given kept set's CSR checked on the device (triton_kernels/csr_check.py and the sort of
its keys) against a brute-force reading of its rules and against the CPU op
ppo_kernels::check_kept_ids, on a CUDA device where one is present, else under the Triton
interpreter (CPU tensors): every rule broken once, random sets (empty rows, ids out of
range, repeats in one block and across blocks, offsets out of order), and ppo_loss with a
given kept set on the device path (_backends.device_eager forced), whose loss, gradient
and metrics are those of the eager checks' path and whose bad sets raise the CPU op's
messages."""

import random

import pytest
import torch

import ppo_kernels as pk
from ppo_kernels import sampling
from ppo_kernels.triton_kernels import csr_check

from helpers import device_path
from helpers.backends import TRITON_DEVICE as DEV, triton_ops
from helpers.inputs import random_csr
from test_sampling import BAD_CSR

pytestmark = triton_ops


def brute_force(ids, offs, vocab):
    """The four rules (sampling.CSR_RULES' order) read off the lists one by one; the
    uniqueness rule over the in-range ids of each row, where the offsets hold."""
    n, nnz = len(offs) - 1, len(ids)
    ends = offs[0] == 0 and offs[-1] == nnz
    order = all(offs[i + 1] >= offs[i] for i in range(n))
    inside = all(0 <= v < vocab for v in ids)
    unique = True
    if ends and order:
        for r in range(n):
            row = [v for v in ids[offs[r]:offs[r + 1]] if 0 <= v < vocab]
            unique &= len(set(row)) == len(row)
    return [ends, order, inside, unique]


def flags(ids, offs, vocab):
    """The four rules as check_replay reads them on the device: the kernel's three flags,
    and equal neighbours among its sorted keys for the fourth."""
    got, keys = csr_check.csr_check(torch.tensor(ids, dtype=torch.long, device=DEV),
                                    torch.tensor(offs, dtype=torch.long, device=DEV), vocab)
    assert got.dtype == torch.int32 and got.shape == (3,) and set(got.tolist()) <= {-1, 0}
    srt = keys.sort().values
    return [v == -1 for v in got.tolist()] + [bool((srt[1:] != srt[:-1]).all())]


@pytest.mark.parametrize("name", ["good", *BAD_CSR])
def test_each_rule_broken_once(name):
    ids, offs = ([0, 1, 4], [0, 2, 2, 3, 3]) if name == "good" else BAD_CSR[name]
    want, got = brute_force(ids, offs, 5), flags(ids, offs, 5)
    assert got[:3] == want[:3]
    # the keys are undefined where the offsets are broken (an id no row names keeps
    # torch.empty's bits, which may repeat another key): the fourth rule only where they
    # hold, as check_replay reads the flags
    if want[0] and want[1]:
        assert got[3] == want[3]
    assert all(want) == (name == "good")


@pytest.mark.parametrize("seed", range(4))
def test_random_sets_against_brute_force(seed):
    """Random sets of up to 9 ids per row (blocks of 4 under the interpreter, so a repeat
    falls in one block or across two), some ids out of range, some offsets moved."""
    rng = random.Random(seed * 7919 + 1)
    for _ in range(40):
        n, vocab = rng.randint(1, 9), rng.randint(1, 12)
        sizes = [rng.randint(0, 9) for _ in range(n)]
        offs = [0]
        for k in sizes:
            offs.append(offs[-1] + k)
        nnz = offs[-1]
        ids = [rng.randint(-2, vocab + 1) if rng.random() < 0.08 else rng.randrange(vocab)
               for _ in range(nnz)]
        if n > 1 and rng.random() < 0.2:
            offs[rng.randint(1, n - 1)] = rng.randint(-1, nnz + 1)
        want, got = brute_force(ids, offs, vocab), flags(ids, offs, vocab)
        assert got[:3] == want[:3], (ids, offs, vocab)
        if want[0] and want[1]:  # (rows are only defined where the offsets hold)
            assert got[3] == want[3], (ids, offs, vocab)


def test_keys_and_repeats_across_blocks_and_rows():
    """The keys are row * V + id; an id twice in one block, twice in a row far past its
    first block, and once in each of two rows (not a repeat)."""
    _, keys = csr_check.csr_check(torch.tensor([3, 1, 0, 4, 2], device=DEV),
                                  torch.tensor([0, 2, 2, 5], device=DEV), 5)
    assert keys.tolist() == [3, 1, 10 + 0, 10 + 4, 10 + 2]
    assert flags([3, 1, 3], [0, 3], 5) == [True, True, True, False]
    assert flags(list(range(40)) + [37], [0, 41], 40) == [True, True, True, False]
    assert all(flags([2, 4, 4, 2, 2, 4], [0, 2, 4, 6], 5))


@pytest.mark.skipif(DEV == "cuda", reason="a failing device assertion ends the CUDA "
                    "context; checked under the interpreter, where it raises at once")
@pytest.mark.parametrize("name", list(BAD_CSR))
def test_check_replay_on_the_device_path_raises_the_cpu_ops_message(monkeypatch, name):
    """check_replay(device=True) with tensors it may not read on the host asserts with the
    message the CPU op raises as a ValueError, through the kernel alone (no eager check)."""
    tokens = torch.zeros(2, 2, dtype=torch.long)
    ids, offs = (torch.tensor(v) for v in BAD_CSR[name])
    with pytest.raises(ValueError) as cpu:
        sampling.check_replay(pk.SamplingMask(ids, offs), None, None, None, tokens, 5)
    calls = device_path.spy(monkeypatch, csr_check, "csr_check")
    monkeypatch.setattr(sampling.ck, "host_readable", lambda x: False)
    dev = [v.to(DEV) for v in (ids, offs, tokens)]
    with pytest.raises(RuntimeError) as device:
        sampling.check_replay(pk.SamplingMask(*dev[:2]), None, None, None, dev[2], 5,
                              device=True)
    assert str(cpu.value) in str(device.value) and calls == [1]


def _inputs(seed=3, B=3, T=5, V=11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 2
    tokens = torch.randint(0, V, (B, T), generator=g)
    old = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0] + 0.1
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    mask = torch.rand(B, T, generator=g) > 0.2
    kept, _ = random_csr(B, T, V, g, tokens=tokens, empty_frac=0.2)  # (some rows empty)
    return (*(v.to(DEV) for v in (logits, tokens, old, adv, mask)),
            pk.SamplingMask(*(v.to(DEV) for v in kept)))


def test_ppo_loss_with_a_given_set_on_the_device_path(monkeypatch):
    """The triton backend's ppo_loss with a given kept set and a KL: the device path (the
    kernel checks the set) gives the eager path's loss, gradient and metrics."""
    logits, tokens, old, adv, mask, kept = _inputs()
    kw = dict(backend="triton", sampling_mask=kept, ref_logprobs=old - 0.05, kl_coef=0.1)
    want, got, calls = device_path.eager_and_device(monkeypatch, csr_check, "csr_check",
                                                    logits, tokens, old, adv, mask, **kw)
    assert calls == [1]
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-7)
    assert set(got[2]) == set(want[2])
