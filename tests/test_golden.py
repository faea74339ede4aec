"""Every public op over a grid of options gives the results frozen in
tests/data/golden_cpu.npz (tests/golden_cases.py), bit for bit on the torch those were
made with: the layers between the public call and the kernels (the option record, the
kernel schemas, the orchestration) can change without changing any result."""

import numpy as np
import pytest
import torch

import golden_cases

FROZEN = np.load(golden_cases.DATA)
EXACT = str(FROZEN["torch_version"]) == torch.__version__


@pytest.fixture(scope="module")
def computed():
    return golden_cases.compute()


def test_every_frozen_case_is_computed(computed):
    frozen = set(FROZEN.files) - {"torch_version"}
    assert frozen == set(computed), sorted(frozen ^ set(computed))[:10]


@pytest.mark.parametrize("prefix", sorted({"/".join(k.split("/")[:3]) for k in FROZEN.files
                                           if k != "torch_version"}))
def test_outputs_match_frozen_table(computed, prefix):
    """Bit-identical with the torch the table was written with; on another torch (its
    matmul and reductions may round differently) within float32 rounding."""
    keys = [k for k in computed if k.startswith(prefix + "/")]
    assert keys
    for k in keys:
        a, b = computed[k], FROZEN[k]
        assert a.shape == b.shape and a.dtype == b.dtype, k
        if EXACT:
            assert np.array_equal(a, b, equal_nan=True), (k, np.nanmax(np.abs(a - b)))
        else:
            tol = 1e-12 if a.dtype == np.float64 else 2e-2 if "bf16" in k else 1e-5
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=k)
