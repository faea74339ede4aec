"""Every @triton.jit kernel of ppo_kernels.triton_kernels lowers to PTX and a cubin for
sm_90 (Hopper), for each logits dtype it is launched with, without a GPU.

The interpreter (TRITON_INTERPRET=1, used by test_triton_kernels.py on machines without a GPU)
never runs the compiler, so type errors in lowering, unsupported ops, or a config that
needs more shared memory than an SM has would only show up on a GPU machine. Here each
kernel goes through triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32)).

triton.jit decides at decoration time whether it builds an interpreted function, so the
compilation runs in a child process with TRITON_INTERPRET unset (this process may have
it set, by tests/helpers/backends.py; helpers/child.run_child). One child compiles every
variant and reports JSON; the tests below assert on its report.
"""

import pathlib

import pytest

from helpers.child import run_child

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMEM_LIMIT = 232448  # max dynamic shared memory per block on sm_90 (227 KiB)

N_FLOAT_SLOTS = 9  # len(ppo_kernels.spec.FLOAT_SLOTS), checked by test_slot_count
LOGITS = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16", "fp64": "*fp64"}


def _row_types(logits, acc="fp32"):
    """Argument types of the row kernels, as the launcher passes them."""
    a = f"*{acc}"
    return {
        "logits_ptr": LOGITS[logits], "grad_ptr": LOGITS[logits],
        "stride_lb": "i64", "stride_lt": "i64", "stride_gb": "i64", "stride_gt": "i64",
        "tokens_ptr": "*i64", "mask_ptr": "*i1",
        "logp_ptr": a, "ent_ptr": a, "max_ptr": a, "lsum_ptr": a, "ref_ptr": a, "kl_ptr": a,
        "rew_ptr": a,
        "glogp_ptr": a, "gent_ptr": a, "old_ptr": a, "adv_ptr": a, "w_ptr": a,
        "isw_ptr": a, "went_ptr": a, "loss_tok_ptr": a, "invt_ptr": a,
        "T": "i32", "TL": "i32", "TG": "i32", "V": "i32", "ROWS": "i32",
        "inv_temp": "fp64", "kl_coef": "fp64", "clip_eps_low": "fp64",
        "clip_eps_high": "fp64", "dual_clip_c": "fp64", "entropy_coef": "fp64",
        "grad_scale": "fp64", "sapo_tau_pos": "fp64", "sapo_tau_neg": "fp64",
        "temperature": "fp64",  # (the ppo_loss options: ppo_kernels/spec.py FLOAT_SLOTS)
    }


def _scale_types(grad, acc):
    """scale_grad_'s kernels: the gradient rows and the two 0-d scalars of ACC."""
    return {"grad_ptr": LOGITS[grad], "stride_gb": "i64", "stride_gt": "i64",
            "go_ptr": f"*{acc}", "applied_ptr": f"*{acc}", "TL": "i32", "V": "i32"}


def _gae_types(acc):
    a = f"*{acc}"
    return {"rew_ptr": a, "val_ptr": a, "mask_ptr": "*i1", "boot_ptr": a, "scores_ptr": a,
            "lams_ptr": a, "adv_ptr": a, "ret_ptr": a, "rew_out_ptr": a, "T": "i32",
            "gamma": "fp64", "lam": "fp64", "value_lam": "fp64"}


HOPPER = {"num_warps": 8}  # a mid config of _config._HOPPER_ROW_CONFIGS

# name -> (module, kernel attribute, types, constexprs (ACC as "fp32"/"fp64"), options)
VARIANTS = {}
for dt in ("fp32", "bf16", "fp16"):
    VARIANTS[f"logprobs_fwd-{dt}"] = (
        "logprobs", "logprobs_fwd_kernel", _row_types(dt),
        dict(ACC="fp32", NEED_ENT=True, SCORE=False, KL_EST=0, BLOCK_V=4096), HOPPER)
    VARIANTS[f"logprobs_bwd-{dt}"] = (
        "logprobs", "_logprobs_bwd_kernel", _row_types(dt),
        dict(ACC="fp32", HAS_GENT=True, BLOCK_V=4096), HOPPER)
    VARIANTS[f"ppo_loss-{dt}"] = (
        "ppo_loss", "_ppo_loss_jit", _row_types(dt),
        dict(ACC="fp32", KL_EST=2, HAS_REF=True, HAS_ISW=True, HAS_DUAL=True,
             COMPUTE_GRAD=True, BLOCK_V=4096), HOPPER)
VARIANTS["score_rows-bf16"] = (
    "logprobs", "logprobs_fwd_kernel", _row_types("bf16"),
    dict(ACC="fp32", NEED_ENT=False, SCORE=True, KL_EST=3, BLOCK_V=4096), HOPPER)
VARIANTS["logprobs_bwd-noent-fp32"] = (
    "logprobs", "_logprobs_bwd_kernel", _row_types("fp32"),
    dict(ACC="fp32", HAS_GENT=False, BLOCK_V=4096), HOPPER)
for est in (0, 1, 3):
    VARIANTS[f"ppo_loss-k{est}-nograd-fp32"] = (
        "ppo_loss", "_ppo_loss_jit", _row_types("fp32"),
        dict(ACC="fp32", KL_EST=est, HAS_REF=True, HAS_ISW=False, HAS_DUAL=False,
             COMPUTE_GRAD=False, BLOCK_V=4096), HOPPER)
VARIANTS["ppo_loss-fp64"] = (
    "ppo_loss", "_ppo_loss_jit", _row_types("fp64", "fp64"),
    dict(ACC="fp64", KL_EST=2, HAS_REF=True, HAS_ISW=True, HAS_DUAL=True,
         COMPUTE_GRAD=True, BLOCK_V=2048), HOPPER)
# the extreme autotune configs: smallest block and largest block / most warps
VARIANTS["ppo_loss-bf16-block1k"] = (
    "ppo_loss", "_ppo_loss_jit", _row_types("bf16"),
    dict(ACC="fp32", KL_EST=2, HAS_REF=True, HAS_ISW=True, HAS_DUAL=True,
         COMPUTE_GRAD=True, BLOCK_V=1024), {"num_warps": 4})
VARIANTS["ppo_loss-fp32-block16k"] = (
    "ppo_loss", "_ppo_loss_jit", _row_types("fp32"),
    dict(ACC="fp32", KL_EST=2, HAS_REF=True, HAS_ISW=True, HAS_DUAL=True,
         COMPUTE_GRAD=True, BLOCK_V=16384), {"num_warps": 16})
# the default flags (no ref, no IS weights, no dual clip) and the values the runtime
# specializes as constants: V == 1 (one-entry vocabulary) and T == 1
VARIANTS["ppo_loss-plain-bf16"] = (
    "ppo_loss", "_ppo_loss_jit", _row_types("bf16"),
    dict(ACC="fp32", KL_EST=2, HAS_REF=False, HAS_ISW=False, HAS_DUAL=False,
         COMPUTE_GRAD=True, BLOCK_V=4096), HOPPER)
VARIANTS["ppo_loss-V1-fp32"] = (
    "ppo_loss", "_ppo_loss_jit", _row_types("fp32"),
    dict(ACC="fp32", KL_EST=2, HAS_REF=True, HAS_ISW=False, HAS_DUAL=False,
         COMPUTE_GRAD=True, BLOCK_V=128, V=1), {"num_warps": 1})
VARIANTS["logprobs_fwd-T1-bf16"] = (
    "logprobs", "logprobs_fwd_kernel", _row_types("bf16"),
    dict(ACC="fp32", NEED_ENT=True, SCORE=False, KL_EST=0, BLOCK_V=4096, T=1), HOPPER)
# scale_grad_ (grad *= grad_output / applied, in place) for every gradient dtype, and the
# one-program kernel that updates `applied` after it
for dt in ("fp32", "bf16", "fp16", "fp64"):
    acc = "fp64" if dt == "fp64" else "fp32"
    VARIANTS[f"scale_grad-{dt}"] = (
        "ppo_loss", "_scale_grad_kernel", _scale_types(dt, acc),
        dict(ACC=acc, BLOCK_V=4096), HOPPER)
for acc in ("fp32", "fp64"):
    VARIANTS[f"scale_grad_commit-{acc}"] = (
        "ppo_loss", "_scale_grad_commit_kernel", _scale_types("fp32", acc), {},
        {"num_warps": 1})
# (vapo: VAPO's lambda per sequence and the decoupled returns' second scan)
for acc, flags in (("fp32", dict(HAS_BOOT=True, HAS_SCORES=False)),
                   ("fp32", dict(HAS_BOOT=False, HAS_SCORES=True)),
                   ("fp64", dict(HAS_BOOT=True, HAS_SCORES=True)),
                   ("fp32", dict(HAS_BOOT=False, HAS_SCORES=True, HAS_LAMS=True,
                                 DECOUPLED=True))):
    flags = dict(dict(HAS_LAMS=False, DECOUPLED=False), **flags)
    name = (f"gae-{acc}-{'boot' if flags['HAS_BOOT'] else 'scores'}"
            f"{'-vapo' if flags['DECOUPLED'] else ''}")
    VARIANTS[name] = ("gae", "_gae_kernel", _gae_types(acc),
                      dict(ACC=acc, BLOCK_T=1024, **flags), {"num_warps": 4})

# the metrics' two launches (metrics.py): a token loss with everything on, a sequence loss
# on-policy, float64; and the reduction
def _metrics_types(acc):
    a = f"*{acc}"
    return {"logp_ptr": a, "ent_ptr": a, "mask_ptr": "*i1", "old_ptr": a, "adv_ptr": a,
            "ref_ptr": a, "roll_ptr": a, "isw_ptr": a, "lkl_ptr": a, "part_ptr": "*fp64",
            "T": "i32",
            "clip_eps_low": "fp64", "clip_eps_high": "fp64", "dual_clip_c": "fp64"}


for acc, pl, flags in (("fp32", 0, dict(HAS_OLD=True, HAS_REF=True, HAS_ROLL=True,
                                         HAS_ISW=True, HAS_DUAL=True, HAS_LKL=True)),
                       ("fp32", 5, dict(HAS_OLD=False, HAS_REF=True, HAS_ROLL=False,
                                        HAS_ISW=False, HAS_DUAL=False, HAS_LKL=False)),
                       ("fp64", 7, dict(HAS_OLD=True, HAS_REF=False, HAS_ROLL=True,
                                        HAS_ISW=False, HAS_DUAL=False, HAS_LKL=False))):
    VARIANTS[f"metrics_rows-pl{pl}-{acc}"] = (
        "metrics", "_rows_kernel", _metrics_types(acc),
        dict(ACC=acc, PL=pl, KL_EST=2, BLOCK=1024, **flags), {"num_warps": 4})
for acc in ("fp32", "fp64"):
    VARIANTS[f"metrics_finish-{acc}"] = (
        "metrics", "_finish_kernel", {"part_ptr": "*fp64", "out_ptr": "*fp32", "B": "i32"},
        dict(ACC=acc, SEQ=True, HAS_REF=True, HAS_ROLL=True, BLOCK=1024), {"num_warps": 4})

# the weights' two launches (weights.py): the id check, each rollout-correction mode
def _weights_types(acc):
    a = f"*{acc}"
    return {"mask_ptr": "*i1", "tokens_ptr": "*i64", "counts_ptr": "*i32", "old_ptr": a,
            "roll_ptr": a, "lsum_ptr": a, "w_ptr": a, "ok_ptr": "*i1", "rc_ptr": a,
            "T": "i32", "V": "i32", "B": "i32", "denom": "fp64", "lo": "fp64", "hi": "fp64"}


for acc, mode, rc in (("fp32", 0, -1), ("fp32", 3, 0), ("fp32", 2, 3), ("fp64", 0, 4),
                      ("fp64", 1, 1), ("fp32", 0, 2)):
    VARIANTS[f"weights_counts-rc{rc}-{acc}"] = (
        "weights", "_counts_kernel", _weights_types(acc),
        dict(CHECK=True, RC=rc, ACC=acc, BLOCK=1024), {"num_warps": 4})
    VARIANTS[f"weights_rows-m{mode}-rc{rc}-{acc}"] = (
        "weights", "_weights_kernel", _weights_types(acc),
        dict(MODE=mode, CHECK=rc != 1, RC=rc, ACC=acc, BLOCK=1024), {"num_warps": 4})


# a given kept set's CSR check (csr_check.py)
VARIANTS["csr_check"] = (
    "csr_check", "_csr_check_kernel",
    {"ids_ptr": "*i64", "offs_ptr": "*i64", "keys_ptr": "*i64", "flags_ptr": "*i32",
     "n": "i32", "nnz": "i32", "V": "i32"}, dict(BLOCK_K=128), {"num_warps": 4})

# replay's kept mass (kept_mass.py): both accumulation dtypes, a number and per-row
# temperatures
for acc in ("fp32", "fp64"):
    for row_temp in (False, True):
        VARIANTS[f"kept_mass-{acc}{'-row-temp' if row_temp else ''}"] = (
            "kept_mass", "_kept_mass_kernel",
            {**{n: f"*{acc}" for n in ("kmax_ptr", "kls_ptr", "rmax_ptr", "ls_ptr",
                                       "temps_ptr", "out_ptr")},
             "mask_ptr": "*i1", "N": "i32", "temperature": "fp64"},
            dict(ACC=acc, ROW_TEMP=row_temp, BLOCK=1024), {"num_warps": 4})


# the re-derived kept sets' threshold (threshold.py): every logits dtype, every rule on,
# and no rule (a bare max sweep)
def _threshold_types(logits):
    return {"logits_ptr": LOGITS[logits], "stride_lb": "i64", "stride_lt": "i64",
            "mask_ptr": "*i1", "topk_ptr": "*i64", "topp_ptr": "*fp64", "minp_ptr": "*fp64",
            "temps_ptr": "*fp32", "out_ptr": "*fp64", "T": "i32", "V": "i32",
            "temperature": "fp64"}


for dt, on in (("bf16", True), ("fp16", True), ("fp32", True), ("fp64", True),
               ("bf16", False)):
    VARIANTS[f"threshold-{dt}{'' if on else '-off'}"] = (
        "threshold", "_threshold_kernel", _threshold_types(dt),
        dict(HAS_K=on, HAS_P=on, HAS_MINP=on, ROW_TEMP=on, KEY_BITS=int(dt[-2:]),
             RADIX_BITS=4, BLOCK=256), {"num_warps": 4})


# GSPO's middle (seq_loss.py): gspo and gspo-token with every input, float64
def _seq_types(acc):
    a = f"*{acc}"
    return {**{n: a for n in ("logp_ptr", "ent_ptr", "old_ptr", "adv_ptr", "ref_ptr",
                              "isw_ptr", "w_ptr", "went_ptr", "dlogp_ptr", "dent_ptr",
                              "pol_ptr", "part_ptr")},
            "mask_ptr": "*i1", "T": "i32", "clip_eps_low": "fp64", "clip_eps_high": "fp64",
            "dual_clip_c": "fp64", "kl_coef": "fp64", "entropy_coef": "fp64"}


for acc, token, flags in (("fp32", False, (True, True, True, True, True, True)),
                          ("fp32", True, (True, True, True, True, True, True)),
                          ("fp32", False, (False, False, False, False, False, False)),
                          ("fp64", True, (True, True, False, True, False, True))):
    VARIANTS[f"seq_loss-{'token' if token else 'seq'}-{sum(flags)}-{acc}"] = (
        "seq_loss", "_seq_loss_kernel", _seq_types(acc),
        dict(ACC=acc, TOKEN=token, KL_EST=2, BLOCK=1024,
             **dict(zip(("HAS_OLD", "HAS_REF", "HAS_ISW", "HAS_WENT", "HAS_DUAL", "KL_BIAS"),
                        flags))), {"num_warps": 4})

# the token-level losses' middle (token_middle.py): each policy loss, the KL on log-probs of
# its own or on logp, float64
def _token_middle_types(acc):
    a = f"*{acc}"
    return {**{n: a for n in ("logp_ptr", "lkl_ptr", "ent_ptr", "old_ptr", "adv_ptr",
                              "ref_ptr", "isw_ptr", "w_ptr", "went_ptr", "dlogp_ptr",
                              "dkl_ptr", "dent_ptr", "pol_ptr", "part_ptr")},
            "mask_ptr": "*i1", "N": "i32",
            **{n: "fp64" for n in ("clip_eps_low", "clip_eps_high", "dual_clip_c", "kl_coef",
                                   "entropy_coef", "temperature", "grad_scale",
                                   "sapo_tau_pos", "sapo_tau_neg")}}


for acc, pl, flags in (("fp32", 0, (True, True, True, True, True, True, True)),
                       ("fp32", 1, (True, True, False, False, False, False, True)),
                       ("fp32", 2, (False, True, True, True, False, True, False)),
                       ("fp32", 3, (True, True, False, False, True, False, True)),
                       ("fp64", 4, (True, True, True, True, False, True, True))):
    VARIANTS[f"token_middle-pl{pl}-{sum(flags)}-{acc}"] = (
        "token_middle", "_token_middle_kernel", _token_middle_types(acc),
        dict(ACC=acc, POLICY_LOSS=pl, KL_EST=2, BLOCK=1024,
             **dict(zip(("HAS_OLD", "HAS_REF", "HAS_ISW", "HAS_WENT", "HAS_DUAL", "KL_BIAS",
                         "HAS_LKL"), flags))), {"num_warps": 4})

# the loss menu: each policy loss, the KL bias correction, on-policy (no
# old_logprobs), separate entropy weights, the straight-through KL estimators
for dt in ("fp32", "bf16"):
    for pl, est in ((0, 4), (1, 5), (2, 2)):
        VARIANTS[f"ppo_loss-pl{pl}-menu-{dt}"] = (
            "ppo_loss", "_ppo_loss_jit", _row_types(dt),
            dict(ACC="fp32", KL_EST=est, HAS_REF=True, HAS_ISW=True, HAS_DUAL=pl == 0,
                 HAS_OLD=False, HAS_WENT=True, POLICY_LOSS=pl, KL_BIAS=True,
                 COMPUTE_GRAD=True, BLOCK_V=4096), HOPPER)
        VARIANTS[f"ppo_loss-pl{pl}-plain-{dt}"] = (
            "ppo_loss", "_ppo_loss_jit", _row_types(dt),
            dict(ACC="fp32", KL_EST=est, HAS_REF=True, HAS_ISW=False, HAS_DUAL=False,
                 HAS_OLD=True, HAS_WENT=False, POLICY_LOSS=pl, KL_BIAS=False,
                 COMPUTE_GRAD=True, BLOCK_V=4096), HOPPER)
VARIANTS["ppo_loss-sapo-bias-fp64"] = (
    "ppo_loss", "_ppo_loss_jit", _row_types("fp64", "fp64"),
    dict(ACC="fp64", KL_EST=5, HAS_REF=True, HAS_ISW=True, HAS_DUAL=False, HAS_OLD=True,
         HAS_WENT=True, POLICY_LOSS=2, KL_BIAS=True, COMPUTE_GRAD=True, BLOCK_V=2048), HOPPER)
# the loss-menu constexprs the older variants leave at their defaults (vanilla PPO with
# old_logprobs, entropy weights = weights, no KL bias correction)
_MENU_DEFAULTS = dict(HAS_OLD=True, HAS_WENT=False, POLICY_LOSS=0, KL_BIAS=False,
                      ONE_TILE=False, PERSIST=0)
for _name, (_mod, _attr, _types, _consts, _opts) in list(VARIANTS.items()):
    if _attr == "_ppo_loss_jit":
        VARIANTS[_name] = (_mod, _attr, _types, {**_MENU_DEFAULTS, **_consts}, _opts)
# a persistent grid's config (PERSIST: the launcher's grid; the kernel loops over rows
# either way)
VARIANTS["ppo_loss-persist-bf16"] = (
    "ppo_loss", "_ppo_loss_jit", _row_types("bf16"),
    dict(_MENU_DEFAULTS, ACC="fp32", KL_EST=2, HAS_REF=True, HAS_ISW=True, HAS_DUAL=True,
         COMPUTE_GRAD=True, BLOCK_V=16384, PERSIST=1), {"num_warps": 16})
# the whole row in registers (ONE_TILE, _config.tile_row_configs): the largest blocks,
# every logits dtype, and float64
for dt, bv, w in (("bf16", 32768, 16), ("fp16", 32768, 32), ("bf16", 65536, 32),
                  ("fp32", 32768, 16), ("bf16", 128, 1)):
    VARIANTS[f"ppo_loss-tile{bv}-{dt}"] = (
        "ppo_loss", "_ppo_loss_jit", _row_types(dt),
        dict(_MENU_DEFAULTS, ACC="fp32", KL_EST=2, HAS_REF=True, HAS_ISW=True, HAS_DUAL=True,
             COMPUTE_GRAD=True, BLOCK_V=bv, ONE_TILE=True), {"num_warps": w})
VARIANTS["ppo_loss-tile-fp64"] = (
    "ppo_loss", "_ppo_loss_jit", _row_types("fp64", "fp64"),
    dict(_MENU_DEFAULTS, ACC="fp64", KL_EST=2, HAS_REF=True, HAS_ISW=True, HAS_DUAL=True,
         COMPUTE_GRAD=True, BLOCK_V=4096, ONE_TILE=True), HOPPER)
# the per-row temperature (ROW_TEMP: each row's 1 / T loaded from invt_ptr): off in the
# variants above, on in the copies below
_ROW_KERNELS = ("_ppo_loss_jit", "logprobs_fwd_kernel", "_logprobs_bwd_kernel")
for _name, (_mod, _attr, _types, _consts, _opts) in list(VARIANTS.items()):
    if _attr in _ROW_KERNELS:
        VARIANTS[_name] = (_mod, _attr, _types, {"ROW_TEMP": False, **_consts}, _opts)
for _base in ("ppo_loss-bf16", "logprobs_fwd-bf16", "logprobs_bwd-fp32", "score_rows-bf16",
              "ppo_loss-fp64"):
    _mod, _attr, _types, _consts, _opts = VARIANTS[_base]
    VARIANTS[_base + "-row-temp"] = (_mod, _attr, _types, {**_consts, "ROW_TEMP": True}, _opts)

# Kernels whose 16-byte alignment the runtime would know (it specializes pointers and
# ints divisible by 16): with that, the vocabulary loop must use 128-bit loads.
ALIGNED = {"ppo_loss-bf16-aligned": "ppo_loss-bf16", "ppo_loss-tile-bf16-aligned":
           "ppo_loss-tile32768-bf16", "logprobs_fwd-fp16-aligned":
           "logprobs_fwd-fp16", "scale_grad-bf16-aligned": "scale_grad-bf16"}

CHILD = r"""
import importlib, importlib.util, json, os, sys, traceback
ROOT = sys.argv[1]
spec_in = json.loads(sys.stdin.read())
sys.path.insert(0, ROOT)
importlib.import_module("ppo_kernels.triton_kernels")
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TL = {"fp32": tl.float32, "fp64": tl.float64}
target = GPUTarget("cuda", 90, 32)
out = {}
for name, (modname, attr, types, consts, options, aligned) in spec_in.items():
    try:
        kern = getattr(importlib.import_module("ppo_kernels.triton_kernels." + modname), attr)
        fn = kern
        while not isinstance(fn, triton.runtime.jit.JITFunction):
            fn = fn.fn                          # an Autotuner wraps the JITFunction
        consts = {k: TL.get(v, v) if k == "ACC" else v for k, v in consts.items()}
        # (a tuple argument's types come as a JSON list)
        sig = {n: ("constexpr" if n in consts else
                   tuple(types[n]) if isinstance(types[n], list) else types[n])
               for n in fn.arg_names}
        attrs = None
        if aligned:
            attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                     if n not in consts and isinstance(sig[n], str) and
                     (sig[n].startswith("*") or n.startswith("stride") or n == "V")}
        # constexprs keyed by (argument index,): accepted by every triton from 3.2 on
        # (3.8 also takes names)
        ckeys = {(fn.arg_names.index(n),): v for n, v in consts.items()}
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=ckeys, attrs=attrs),
                           target=target, options=options)
        ptx = k.asm.get("ptx", "")
        out[name] = {"keys": sorted(k.asm.keys()), "ptx": len(ptx),
                     "cubin": len(k.asm.get("cubin", b"")),
                     "shared": int(getattr(k.metadata, "shared", 0)),
                     "v4_loads": ptx.count("ld.global.v4"),
                     "target": ".target sm_90" in ptx}
    except Exception:
        out[name] = {"error": traceback.format_exc()}
print("@@JSON@@" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled():
    spec = {n: (*v, False) for n, v in VARIANTS.items()}
    spec.update({n: (*VARIANTS[base], True) for n, base in ALIGNED.items()})
    return run_child(CHILD, ROOT, stdin=spec, what="compiler child")


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_kernel_lowers_to_ptx_and_cubin_sm90(compiled, name):
    res = compiled[name]
    assert "error" not in res, res.get("error")
    assert {"ptx", "cubin"} <= set(res["keys"])
    assert res["ptx"] > 0 and res["cubin"] > 0
    assert res["target"], "PTX is for sm_90"
    assert res["shared"] <= SMEM_LIMIT, f"{res['shared']} bytes of shared memory"


@pytest.mark.parametrize("name", sorted(ALIGNED))
def test_vocab_loop_vectorizes_when_aligned(compiled, name):
    """With 16-byte aligned rows (V a multiple of 8 for 16-bit logits: 32000, 151936),
    the logits are read with 128-bit loads, which a bandwidth-bound kernel needs."""
    res = compiled[name]
    assert "error" not in res, res.get("error")
    assert res["v4_loads"] > 0


def test_slot_count():
    from ppo_kernels.spec import FLOAT_SLOTS

    assert N_FLOAT_SLOTS == len(FLOAT_SLOTS)


# ------------------------------------------------------------------ launch specialisation
# The types above are what the kernels are meant to receive; what a GPU compiles is what the
# JIT derives from the launcher's actual arguments. A Python float is specialised as fp32
# by triton's JIT (even inside a tuple) unless the parameter is annotated (tl.float64):
# the 9 ppo_loss options once went in as a tuple of floats and cost float64 runs 1e-9 ..
# 8e-8 relative on a GPU while the interpreter (which keeps Python floats) passed. The
# child below runs every launcher on float64 CPU tensors with the kernels replaced by
# recorders, binds each recorded launch with triton's own binder for an sm_90 target
# (create_function_from_signature, as JITFunction.run does), and compiles the ppo_loss
# float64 specialisation so derived to PTX.

LAUNCH_CHILD = r"""
import json, math, re, sys, traceback
sys.path.insert(0, sys.argv[1])
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction, create_function_from_signature
import importlib
import ppo_kernels.triton_kernels as tk
# (the modules: the package binds `gae` to the function)
distill, gae, logprobs, ppo_loss, sampling = (
    importlib.import_module("ppo_kernels.triton_kernels." + m)
    for m in ("distill", "gae", "logprobs", "ppo_loss", "sampling"))

target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
calls = []

class Recorder:
    def __init__(self, kern):
        self.kern = kern
    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            jit, extra = self.kern, {}
            while not isinstance(jit, JITFunction):
                if isinstance(jit, Autotuner):  # the autotuner supplies a config's meta
                    extra = {**jit.configs[0].all_kwargs(), **extra}
                jit = jit.fn
            calls.append((jit, args, {**extra, **kwargs}))
        return launch

# the launch sites call _config.wrap(kernel) (torch's wrap_triton): the recorder itself
importlib.import_module("ppo_kernels.triton_kernels._config").wrap = lambda k: k
for mod in (distill, gae, logprobs, ppo_loss, sampling):
    for name, obj in list(vars(mod).items()):
        if isinstance(obj, (JITFunction, Autotuner)) and (name.endswith("kernel") or
                                                         name.endswith("_jit")):
            setattr(mod, name, Recorder(obj))

f64 = torch.float64
gen = torch.Generator().manual_seed(0)
B, T, V = 2, 3, 5
logits = torch.randn(B, T, V, dtype=f64, generator=gen)
tokens = torch.randint(0, V, (B, T), generator=gen)
mask = torch.ones(B, T, dtype=torch.bool)
pt = lambda: torch.rand(B, T, dtype=f64, generator=gen)
scal = [0.2, 0.28, 3.0, 0.1, 0.01, 0.7, 1.0 / 3.0, 1.0, 1.05]  # FLOAT_SLOTS order
codes = [0, 2, 1]
thr = torch.full((B, T), -math.inf, dtype=f64)
offs = torch.arange(B * T + 1, dtype=torch.int64)
ids = torch.zeros(B * T, dtype=torch.int64)
runs = {
    "ppo_loss_fwd": lambda: tk.ppo_loss_fwd(logits, tokens, mask, pt(), pt(), pt(), pt(), pt(),
                                            pt(), scal, codes, True),
    "ppo_loss_fwd_inplace": lambda: tk.ppo_loss_fwd_inplace(
        logits.clone(), tokens, mask, pt(), pt(), pt(), pt(), pt(), pt(), scal, codes),
    "scale_grad_": lambda: tk.scale_grad_(logits.clone(), torch.tensor(0.3, dtype=f64),
                                          torch.tensor(0.7, dtype=f64)),
    "token_logprobs_fwd": lambda: tk.token_logprobs_fwd(logits, tokens, mask, 0.7, True),
    "token_logprobs_bwd": lambda: tk.token_logprobs_bwd(pt(), pt(), logits, tokens, mask, pt(),
                                                        pt(), pt(), 0.7),
    "gae": lambda: tk.gae(pt(), pt(), mask, torch.rand(B, dtype=f64), 0.99, 0.95,
                          value_lam=0.9),
    "score_rollout": lambda: tk.score_rollout(logits, tokens, mask, pt(), pt(),
                                              torch.rand(B, dtype=f64), 0.1, 2, 0.99, 0.95,
                                              0.7),
    "kept_logprobs_fwd": lambda: sampling.kept_logprobs_fwd(logits, tokens, mask, 0.7, None,
                                                            None, thr),
    "kept_logprobs_bwd_": lambda: sampling.kept_logprobs_bwd_(
        pt(), pt(), logits, tokens, mask, pt(), pt(), pt(), 0.7, None, None, thr,
        torch.empty_like(logits)),
    "kept_logprobs_bwd": lambda: sampling.kept_logprobs_bwd(
        pt(), pt(), logits, tokens, mask, pt(), pt(), pt(), 0.7, None, None, thr),
    "distill_fwd": lambda: distill.distill_fwd(logits, mask, offs, ids,
                                               torch.rand(B * T, dtype=f64), pt(), 0.7,
                                               1.0 / 3.0, True, True),
}
out = {}
for run_name, run in runs.items():
    del calls[:]
    try:
        run()
        launches = []
        for jit, args, kwargs in calls:
            binder = create_function_from_signature(jit.signature, jit.params, backend)
            bound, spec, options = binder(*args, **kwargs)
            floats = {}
            for (name, value), (ty, _) in zip(bound.items(), spec):
                if isinstance(value, float) or (isinstance(value, tuple) and
                                                any(isinstance(v, float) for v in value)):
                    floats[name] = ty
            launches.append({"kernel": jit.fn.__name__, "floats": floats})
            if run_name == "ppo_loss_fwd" and "ptx_params" not in out:
                names = list(bound)
                sig = {n: ty for n, (ty, _) in zip(names, spec)}
                consts = {(i,): bound[n] for i, n in enumerate(names) if sig[n] == "constexpr"}
                k = triton.compile(ASTSource(fn=jit, signature=sig, constexprs=consts),
                                   target=target, options={"num_warps": kwargs["num_warps"]})
                ptx = k.asm["ptx"]
                entry = ptx[ptx.index(".entry"):]
                entry = entry[:entry.index(")")]
                out["ptx_params"] = re.findall(r"\.param \.(\w+)", entry)
        out[run_name] = launches
    except Exception:
        out[run_name] = {"error": traceback.format_exc()}
print("@@JSON@@" + json.dumps(out))
"""

LAUNCHERS = ("ppo_loss_fwd", "ppo_loss_fwd_inplace", "scale_grad_", "token_logprobs_fwd",
             "token_logprobs_bwd", "gae", "score_rollout", "kept_logprobs_fwd",
             "kept_logprobs_bwd_", "kept_logprobs_bwd", "distill_fwd")


@pytest.fixture(scope="module")
def launched():
    from triton.runtime import jit

    if not hasattr(jit, "create_function_from_signature"):
        pytest.skip("this triton has no create_function_from_signature binder")
    return run_child(LAUNCH_CHILD, ROOT, what="launch child")


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_float_arguments_are_specialised_float64(launched, launcher):
    """Every Python float a launcher passes to a kernel (loss options, 1 / temperature,
    gamma, lambda, grad_scale, ...) is specialised fp64 by the JIT, so a float64 run
    rounds none of them to float32 (and a float32 run rounds each once, in the kernel)."""
    res = launched[launcher]
    assert "error" not in res, res["error"] if isinstance(res, dict) else ""
    assert res, "the launcher launched no kernel"
    for launch in res:
        fp32 = {n: t for n, t in launch["floats"].items() if t != "fp64"}
        assert not fp32, f"{launch['kernel']}: float arguments specialised as {fp32}"
    if launcher.startswith("ppo_loss"):
        assert len(res[0]["floats"]) == N_FLOAT_SLOTS + 1  # the options and 1 / temperature


def test_ppo_loss_float64_options_are_f64_in_ptx(launched):
    """The ppo_loss float64 specialisation the launcher's arguments give, compiled for
    sm_90: its scalar parameters are the 9 options and 1 / temperature as .f64 and no
    .f32 at all (the tuple of floats gave `.param .f32` x 9)."""
    params = launched.get("ptx_params")
    assert params, launched.get("ppo_loss_fwd")
    assert "f32" not in params, params
    assert params.count("f64") == N_FLOAT_SLOTS + 1, params


# ------------------------------------------------------------------ exp of the per-token terms
# fp32 tl.exp lowers to ex2.approx.f32 of the rounded product x log2(e) (triton's NVIDIA
# ExpOpConversionApprox): 9e-7 relative at |x| = 20, beyond the contract's 5e-7 for the
# ratio, the KL estimators and the expm1 helpers. Those use _math.exp_acc / exp_split
# (float32 products and sums only); the vocabulary sweeps keep tl.exp. A probe kernel per
# helper (written to a file: triton.jit reads the source) is compiled for sm_90 and its
# PTX searched for ex2.approx; tl.exp itself is the control.

PROBE_SRC = """
import triton
import triton.language as tl
from ppo_kernels.triton_kernels._math import (exp_acc, expm1, expm1_minus_x, kl_term,
                                              pg_term, dlogit_token)


@triton.jit
def probe(x_ptr, y_ptr, N, WHICH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    inb = offs < N
    x = tl.load(x_ptr + offs, mask=inb, other=0.0)
    if WHICH == 0:
        y = tl.exp(x)
    elif WHICH == 1:
        y = exp_acc(x)
    elif WHICH == 2:
        y = expm1(x)
    elif WHICH == 3:
        y = expm1_minus_x(x)
    elif WHICH == 4:
        kl, dkl = kl_term(x, 2)
        y = kl + dkl
    elif WHICH == 5:  # the ratio and the SAPO gate
        pg, grad, rho, dr = pg_term(x, 0.5 * x, x, 0.2, 0.28, 3.0, 1.0, 1.05, False, 2)
        y = pg + grad + rho + dr
    elif WHICH == 6:  # DPPO-KL: p, p_old, log(1 - e^x)
        pg, grad, rho, dr = pg_term(0.0 - x * x, 0.5 * x - 1.0, x, 0.2, 0.28, 3.0, 1.0, 1.05,
                                    False, 4)
        y = pg + grad + rho + dr
    else:  # the token's own dlogit
        y = dlogit_token(0.0 - x * x, exp_acc(0.0 - x * x), x, 0.5 * x, 0.1)
    tl.store(y_ptr + offs, y, mask=inb)
"""

PROBE_CHILD = r"""
import json, pathlib, sys, traceback
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])
pathlib.Path(sys.argv[2], "exp_probe_mod.py").write_text(sys.stdin.read())
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import exp_probe_mod

out = {}
for which in range(8):
    try:
        k = triton.compile(ASTSource(fn=exp_probe_mod.probe,
                                     signature={"x_ptr": "*fp32", "y_ptr": "*fp32",
                                                "N": "i32", "WHICH": "constexpr",
                                                "BLOCK": "constexpr"},
                                     constexprs={(3,): which, (4,): 128}),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        out[which] = k.asm["ptx"].count("ex2.approx")
    except Exception:
        out[which] = traceback.format_exc()
print("@@JSON@@" + json.dumps(out))
"""

PROBES = {0: "tl.exp (control)", 1: "exp_acc", 2: "expm1", 3: "expm1_minus_x", 4: "kl k3",
          5: "pg_term sapo", 6: "pg_term dppo_kl", 7: "dlogit_token"}


@pytest.fixture(scope="module")
def probe_ptx(tmp_path_factory):
    res = run_child(PROBE_CHILD, ROOT, tmp_path_factory.mktemp("exp_probe"), stdin=PROBE_SRC,
                    what="probe child")
    return {int(k): v for k, v in res.items()}


@pytest.mark.parametrize("which", sorted(PROBES), ids=[PROBES[k] for k in sorted(PROBES)])
def test_per_token_exps_avoid_ex2_approx(probe_ptx, which):
    """The per-token helpers compile to PTX without ex2.approx (float32); tl.exp, the
    control, does use it (so the search would see one)."""
    n = probe_ptx[which]
    assert isinstance(n, int), n
    if which == 0:
        assert n > 0
    else:
        assert n == 0, f"{PROBES[which]}: {n} ex2.approx"
