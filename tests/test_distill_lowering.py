"""The Triton distillation kernel (triton_kernels/distill.py) lowered for a
GPU without one: triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32)) must give
PTX and a cubin for sm_90 (catches what the interpreter lets through), for float32,
bfloat16 and float64 logits, with and without the tail and the gradient. The compiler
child is that of tests/test_triton_kernels_lowering.py."""

import pytest

from helpers.child import run_child
from test_triton_kernels_lowering import CHILD, ROOT, SMEM_LIMIT

pytest.importorskip("triton")


def _types(dt, acc="fp32"):
    p = f"*{dt}"
    a = f"*{acc}"
    return dict(logits_ptr=p, stride_lb="i64", stride_lt="i64", mask_ptr="*i1",
                off_ptr="*i64", ids_ptr="*i64", lt_ptr=a, w_ptr=a, kl_ptr=a, ps_ptr=a,
                tt_ptr=a, grad_ptr=p, stride_gb="i64", stride_gt="i64", T="i64", TG="i64",
                V="i32", inv_temp="fp64", grad_scale="fp64")


VARIANTS = {}
for dt, acc in (("fp32", "fp32"), ("bf16", "fp32"), ("fp64", "fp64")):
    for tail in (True, False):
        for grad in (True, False):
            VARIANTS[f"distill-{dt}-tail{int(tail)}-grad{int(grad)}"] = (
                "distill", "_distill_kernel", _types(dt, acc),
                dict(ACC=acc, TAIL=tail, COMPUTE_GRAD=grad, BLOCK_V=4096, BLOCK_K=32),
                {"num_warps": 8}, False)


@pytest.fixture(scope="module")
def compiled():
    return run_child(CHILD, ROOT, stdin=VARIANTS, what="compiler child")


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_distill_kernel_lowers_to_sm90(compiled, name):
    res = compiled[name]
    assert "error" not in res, res.get("error")
    assert {"ptx", "cubin"} <= set(res["keys"])
    assert res["ptx"] > 0 and res["cubin"] > 0 and res["target"]
    assert res["shared"] <= SMEM_LIMIT
