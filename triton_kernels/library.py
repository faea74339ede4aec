"""Registers the Triton kernels as torch operators ppo_kernels::triton_*.

Each op takes the schema of its C++ twin as the compiled extension registered it (csrc/ops.cpp:
the one text of every op's arguments, read here from the dispatcher), under the name
prefixed with ``triton_``; tests/test_triton_kernels.py holds the registered ops to
csrc/ops.cpp. The Triton ops therefore need the compiled extension (ppo_kernels._C) loaded:
without it this module raises ImportError, and the Triton backend reports itself unavailable.
The launchers (logprobs.py, ppo_loss.py, gae.py, sampling.py, distill.py) take their schema's
arguments in its order and are registered as they are; only the implementations live here:
ppo_kernels/_autograd.py registers the fake (meta) and autograd formulas of these names
together with the C++ ops. torch.library.triton_op (rather
than custom_op) lets torch.compile see the kernels inside (each launch goes through
wrap_triton).

Importing this module defines the ops exactly once per process; register() is idempotent
and returns the op handles.
"""

import functools
import inspect
import re
from typing import Optional

import torch
from torch import Tensor
from torch.library import triton_op

from .._extension import not_built_hint

# Functions, not modules: the package namespace binds `gae` to the function (__init__).
from .distill import distill_fwd
from .gae import gae, score_rollout
from .logprobs import token_logprobs_bwd, token_logprobs_fwd
from .ppo_loss import ppo_loss_fwd, ppo_loss_fwd_inplace, scale_grad_
from .sampling import (kept_logprobs_bwd, kept_logprobs_bwd_, kept_logprobs_fwd,
                       threshold_kept_fwd)
from .threshold import sampling_threshold

NAMESPACE = "ppo_kernels"

# name -> the launcher that implements it (its positional arguments in the schema's order)
LAUNCHERS = {
    "triton_token_logprobs_fwd": token_logprobs_fwd,
    "triton_token_logprobs_bwd": token_logprobs_bwd,
    "triton_ppo_loss_fwd": ppo_loss_fwd,
    "triton_ppo_loss_fwd_inplace": ppo_loss_fwd_inplace,
    "triton_scale_grad_": scale_grad_,
    "triton_gae": gae,
    "triton_score_rollout": score_rollout,
    "triton_sampling_threshold": sampling_threshold,
    "triton_kept_logprobs_fwd": kept_logprobs_fwd,
    "triton_kept_logprobs_bwd_": kept_logprobs_bwd_,
    "triton_kept_logprobs_bwd": kept_logprobs_bwd,
    "triton_threshold_kept_fwd": threshold_kept_fwd,
    "triton_distill_fwd": distill_fwd,
}


def _schema(name):
    """The schema of ``triton_<op>`` after its name: the C++ op's (csrc/ops.cpp), as the
    dispatcher holds it (output names included)."""
    cpp = name[len("triton_"):]
    if not hasattr(torch.ops.ppo_kernels, cpp):
        raise ImportError(
            f"ppo_kernels.triton_kernels: the Triton ops take their schemas from the compiled "
            f"extension's (csrc/ops.cpp), and ppo_kernels::{cpp} is not registered: "
            f"{not_built_hint()}")
    text = str(getattr(torch.ops.ppo_kernels, cpp).default._schema)
    return text[text.index("("):]


_TYPES = {"Tensor": Tensor, "float": float, "int": int, "bool": bool,
          "float[]": list[float], "int[]": list[int]}


def _annotation(text):
    """The Python type of a schema type ("Tensor?", "float[]", "Tensor(a!)")."""
    text = re.sub(r"\(\w!?\)", "", text).strip()
    if text.endswith("?"):
        return Optional[_TYPES[text[:-1]]]
    return _TYPES[text]


def _typed(schema, fn):
    """fn with the signature of `schema` (argument names, annotations, defaults): the
    schema written once. triton_op is given the schema, but some torch versions infer it
    from the annotations instead, which the launchers do not carry."""
    args, rets = schema.split(" -> ")
    params = []
    for arg in filter(None, (a.strip() for a in args.strip()[1:-1].split(","))):
        decl, _, default = arg.partition("=")
        typ, pname = decl.rsplit(" ", 1)
        params.append(inspect.Parameter(
            pname, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=_annotation(typ),
            default=inspect.Parameter.empty if not default else
            {"None": None, "True": True, "False": False}.get(default, default)))
    outs = [o.strip().rsplit(" ", 1)[0] if " " in o.strip() else o.strip()
            for o in rets.strip().strip("()").split(",") if o.strip()]
    ret = None if not outs else (Tensor if len(outs) == 1 and not rets.strip().startswith("(")
                                 else tuple[tuple(Tensor for _ in outs)])

    @functools.wraps(fn)
    def impl(*a, **kw):
        return fn(*a, **kw)

    impl.__signature__ = inspect.Signature(params, return_annotation=ret)
    impl.__annotations__ = {p.name: p.annotation for p in params} | {"return": ret}
    return impl


def _mutated(schema):
    """The arguments the schema marks as written, Tensor(a!)."""
    return tuple(re.findall(r"Tensor\(\w!\) (\w+)", schema.split(" -> ")[0]))


_registered = {}


def _already_defined(name):
    """True when ppo_kernels::<name> exists in the dispatcher (defined by an earlier
    import of this file under another module name, or by anyone else)."""
    return torch._C._dispatch_has_kernel(f"{NAMESPACE}::{name}") or any(
        s.name == f"{NAMESPACE}::{name}" for s in torch._C._jit_get_all_schemas())


def register():
    """Define every ppo_kernels::triton_* op once; returns {name: OpOverloadPacket}."""
    if not _registered:
        for name, fn in LAUNCHERS.items():
            if not _already_defined(name):
                schema = _schema(name)
                triton_op(f"{NAMESPACE}::{name}", mutates_args=_mutated(schema),
                          schema=schema)(_typed(schema, fn))
            _registered[name] = getattr(getattr(torch.ops, NAMESPACE), name)
    return dict(_registered)


register()
