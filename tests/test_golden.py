"""Every public op over a grid of options gives the results frozen in
tests/data/golden_cpu.npz (tests/golden_cases.py): the layers between the public call and the
kernels (the option record, the kernel schemas, the orchestration) can change without
changing any result.

What is exact depends on where the table was written (its tags: the torch version, the CPU
capability, the CPU model) and where it is read:
- our CPU kernels on logits (the cpu backend without a matmul: logits, packed rows, token
  log-probs, the rollout scoring, GAE) are bit for bit on the same torch and the same CPU
  capability, whatever the CPU's vendor or model: their reductions are a function of the
  shape and the capability's vector width alone;
- what runs a matmul, torch's own reductions or torch's transcendental functions (the
  from-hidden ops, the eager composite, and the cpu backend's cases whose eager middle
  calls exp, log, tanh, ...: golden_cases.RUNS_VML, recorded as they run) is bit for bit
  only on the same CPU model too: the BLAS, MKL's vector math and some torch kernels pick
  per-CPU paths (an Intel AVX-512 Xeon rounds SAPO's eager exp of the table's AMD EPYC
  differently; MKL_CBWR=COMPATIBLE there gives the EPYC's bits);
- anywhere else (another capability: ATEN_CPU_CAPABILITY=avx2 / default on the same
  machine, another CPU, another torch) every array is within BOUND_ULPS units of its
  dtype's rounding of its own largest entry: the same float result, summed in another order.
A case re-frozen since (golden_cases.py --refreeze: a computation that changed its rounding,
not its result, within that bound) carries the tags of the platform that re-froze it, and
the rule reads those for its arrays.
"""

import numpy as np
import pytest
import torch

import golden_cases

FROZEN = np.load(golden_cases.DATA)
TAGS = golden_cases.TAGS
MADE = {k: str(FROZEN[k]) for k in TAGS}
# the cases re-frozen since (golden_cases.py --refreeze): the platform that made each
MADE_CASE = {k[len(golden_cases.MADE):]: dict(zip(TAGS, map(str, FROZEN[k])))
             for k in FROZEN.files if k.startswith(golden_cases.MADE)}
ARRAYS = [k for k in FROZEN.files if k not in TAGS and not k.startswith(golden_cases.MADE)]
HERE = golden_cases.platform_tags()
BOUND_ULPS = golden_cases.BOUND_ULPS
within_bound = golden_cases.within_bound


def made(key):
    """The tags of the platform that froze key: its case's own where it was re-frozen."""
    return MADE_CASE.get(golden_cases.case_of(key), MADE)


def kernel_only(key):
    """Whether a case runs our CPU kernels alone (no matmul, no torch composite)."""
    _, backend, what = key.split("/")[:3]
    return backend == "cpu" and what in ("logits", "packed", "token_logprobs",
                                         "score_rollout", "gae")


def runs_vml(key):
    """Whether the case's call ran one of torch's transcendental functions (MKL's vector
    math): recorded by golden_cases.compute()."""
    return any(key.startswith(p + "/") for p in golden_cases.RUNS_VML)


def exact(key):
    m = made(key)
    same_build = all(m[k] == HERE[k] for k in ("torch_version", "cpu_capability"))
    same_cpu = same_build and m["cpu_model"] == HERE["cpu_model"]
    return same_cpu or (same_build and kernel_only(key) and not runs_vml(key))


@pytest.fixture(scope="module")
def computed():
    return golden_cases.compute()


def test_every_frozen_case_is_computed(computed):
    frozen = set(ARRAYS)
    assert frozen == set(computed), sorted(frozen ^ set(computed))[:10]


@pytest.mark.parametrize("prefix", sorted({"/".join(k.split("/")[:3]) for k in ARRAYS}))
def test_outputs_match_frozen_table(computed, prefix):
    keys = [k for k in computed if k.startswith(prefix + "/")]
    assert keys
    for k in keys:
        a, b = computed[k], FROZEN[k]
        assert a.shape == b.shape and a.dtype == b.dtype, k
        if exact(k):
            assert np.array_equal(a, b, equal_nan=True), (k, made(k), np.nanmax(np.abs(a - b)))
        else:
            ok, ulps = within_bound(k, a, b)
            assert ok, (k, f"{ulps:.1f} ulps of the largest entry", made(k), HERE)


def test_the_bound_catches_a_real_change(computed):
    """The bound is no blanket: one changed digit of one loss (1e-4 relative) fails it."""
    k = "f32/cpu/logits/vanilla/token-mean/loss"
    changed = computed[k] * np.float32(1 + 1e-4)
    assert not within_bound(k, changed, FROZEN[k])[0]
    assert within_bound(k, computed[k], FROZEN[k])[0]


def test_case_of_a_key():
    assert golden_cases.case_of("f32/cpu/logits/gspo/token-mean/m/clip_frac") == \
        "f32/cpu/logits/gspo/token-mean"
    assert golden_cases.case_of("f32/cpu/logits/seq_adv/dlogits") == "f32/cpu/logits/seq_adv"
    assert golden_cases.case_of("f64/cpu/gae/returns") == "f64/cpu/gae"
    assert set(MADE_CASE) <= {golden_cases.case_of(k) for k in ARRAYS}


def test_kernel_only_cases_are_classified():
    keys = ARRAYS
    assert kernel_only("f32/cpu/logits/vanilla/token-mean/loss")
    assert not kernel_only("f32/cpu/hidden/vanilla/token-mean/dhidden")
    assert not kernel_only("f32/torch/logits/vanilla/token-mean/loss")
    assert not kernel_only("f32/cpu/token_logprobs_from_hidden/dweight")
    assert sum(map(kernel_only, keys)) > len(keys) // 4


def test_vml_cases_are_recorded(computed):
    """The eager middle of VESPO calls exp (recorded); the fused single pass of a
    token-level loss, GSPO's middle op, the token log-probs and GAE call none of torch's
    transcendental functions (our kernels compute theirs), so they stay exact on any CPU
    model."""
    assert runs_vml("f32/cpu/logits/vespo/token-mean/loss")
    assert runs_vml("f32/cpu/logits/sapo/none/dlogits")
    for k in ("f32/cpu/logits/vanilla/token-mean/loss", "f32/cpu/token_logprobs/dlogits",
              "f64/cpu/gae/returns", "f32/cpu/logits/vanilla/token-mean/m/entropy",
              "f32/cpu/logits/gspo/token-mean/dlogits"):
        assert k in computed and not runs_vml(k), k
    ours = [k for k in computed if kernel_only(k)]
    exact_anywhere = [k for k in ours if not runs_vml(k)]
    assert len(exact_anywhere) > len(ours) // 2, (len(exact_anywhere), len(ours))
