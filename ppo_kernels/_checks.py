"""Argument checks shared by the public ops: every bad input becomes a ValueError or
TypeError that names the argument, what was expected and what was given (DESIGN.md,
"Bad input"), before any kernel runs."""

from __future__ import annotations

import math

import torch

# (the name <-> id tables of the options live in ppo_kernels/spec.py)
BACKENDS = ("auto", "cpu", "cuda", "triton", "torch")
LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def tensor(name, x, *, floating=False, integer=False, boolean_ok=False):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if floating and not x.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    if integer and (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool):
        raise TypeError(f"{name}: expected an integer tensor (token ids), got dtype {x.dtype}")
    return x


def same_device(name, x, ref_name, ref):
    if x.device != ref.device:
        raise ValueError(f"{name}: expected a tensor on {ref.device} (the device of {ref_name}),"
                         f" got one on {x.device}")


def choice(name, value, options):
    if value not in options:
        raise ValueError(f"{name}: expected one of {list(options)}, got {value!r}")
    return value


def positive_in(name, value, dtype):
    """A number > 0 that stays a positive normal finite value in dtype (the kernels compute
    with it there: 1e-50 would be 0 in float32, 1e50 inf)."""
    v = number(name, value, lo=0.0, lo_open=True)
    fi = torch.finfo(dtype)
    if not fi.tiny <= v <= fi.max:
        raise ValueError(f"{name}: expected a number in [{fi.tiny:.3g}, {fi.max:.3g}] (a "
                         f"positive normal {dtype} value), got {value!r}")
    return v


def flag(name, value):
    """A bool (not 1 or "yes": a flag that another framework spells as a number is mapped in
    the docs, never guessed)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False, got {value!r}")
    return value


def number(name, value, *, lo=None, hi=None, lo_open=False, hi_open=False):
    """A finite real number inside [lo, hi] (open ends where asked)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    try:
        v = float(value)
    except OverflowError:  # an int past float64's range (10**400) is no finite number
        raise ValueError(f"{name}: expected a finite number, got an int of "
                         f"{value.bit_length()} bits") from None
    # (v - v is 0 exactly for a finite v, NaN for inf and NaN: plain arithmetic, which
    # torch.compile(dynamic=True) traces on a symbolic float, unlike math.isfinite.) No
    # augmented assignment: where dynamo has folded `bad` to a constant, torch 2.11's FX
    # codegen writes `bad |= x` on a symbolic bool as `False |= x`, a SyntaxError
    # (torch/fx/graph.py inplace_methods); `bad = bad | x` is emitted as `False | x`.
    bad = v - v != 0.0
    if lo is not None:
        bad = bad | (v <= lo if lo_open else v < lo)
    if hi is not None:
        bad = bad | (v >= hi if hi_open else v > hi)
    if bad:
        lo_s = "-inf" if lo is None else f"{lo}"
        hi_s = "inf" if hi is None else f"{hi}"
        rng = f"{'(' if lo_open or lo is None else '['}{lo_s}, {hi_s}{')' if hi_open or hi is None else ']'}"
        raise ValueError(f"{name}: expected a finite number in {rng}, got {value!r}")
    return v


def temperature(value, logits, tokens=None, flat=False, mask=None):
    """A temperature > 0 whose reciprocal is a finite normal number in the logits'
    accumulation dtype (temperature_in), or a tensor of them: 0-d (one value, kept on its
    device), per sequence [B] / [B, 1] or per token [B, T] ([N] with flat tokens), of the
    tokens' shape once broadcast (per_token), returned as the [B, T] tensor of the
    accumulation dtype the kernels take (temperature_values).
    Ops that take no tensor pass no tokens: a tensor is then a TypeError."""
    if not isinstance(value, torch.Tensor):
        return temperature_in(value, acc_dtype(logits))
    if tokens is None:
        raise TypeError("temperature: expected a number here, got a tensor")
    if value.dim() == 0:  # one value for the batch, left on its device (no host read)
        value = value.reshape(1, 1).expand(tokens.shape)
        flat = False
    t = per_token("temperature", value, tokens, flat, acc_dtype(logits), per_seq_ok=True)
    return temperature_values(t, mask)


def temperature_values(t, mask):
    """A per-row temperature t [B, T] (the accumulation dtype) against mask [B, T]: every
    valid position's value finite, > 0 and with a reciprocal that is a finite normal number
    in t's dtype, as temperature_in asks of a number; masked positions hold anything and
    become 1 (no backend reads them, the composite divides by them). On CPU tensors a ValueError names
    the first bad position; on a device (and under torch.compile) the check is an
    asynchronous device assertion (a RuntimeError naming `temperature`), with the bad
    values replaced by 1 so that nothing computes with them before it fires."""
    r = t.double().reciprocal().to(t.dtype)
    ok = torch.isfinite(t) & (t > 0) & torch.isfinite(r) & (r >= torch.finfo(t.dtype).tiny)
    bad = mask & ~ok
    if not host_readable(t):
        torch._assert_async(~bad.any(), "temperature: expected finite numbers > 0 (whose "
                                        "reciprocals are finite normal numbers) on valid "
                                        "positions")
    else:
        pb, pt = plain(bad), plain(t)
        if bool(pb.any()):
            idx = [int(i) for i in pb.nonzero()[0]]
            raise ValueError(f"temperature: expected a finite number > 0 whose reciprocal is "
                             f"a finite normal number in {t.dtype} on every valid position; got "
                             f"{float(pt[tuple(idx)])!r} at position {idx}")
    return torch.where(mask & ok, t, 1.0).contiguous()


def split_temperature(temperature):
    """(the float the kernel ops take, their `temperatures` tensor or None) of a checked
    temperature: a number, or the per-row [B, T] tensor (the float is then 1, unread)."""
    if isinstance(temperature, torch.Tensor):
        return 1.0, temperature
    return temperature, None


def temperature_in(value, acc):
    """A temperature > 0 whose reciprocal is a finite normal number in the accumulation
    dtype acc: every kernel multiplies by 1 / temperature, which would overflow to inf (and
    turn the shifted logits into 0 * inf = NaN) below ~2.9e-39 in float32, and underflow to
    a subnormal or 0 (flushed to 0 on a GPU; a -inf entry then shifts to -inf * 0 = NaN)
    above ~8.5e37."""
    t = number("temperature", value, lo=0.0, lo_open=True)
    # (1 / t rounded to acc is inf exactly when 1 / t exceeds acc's max, up to rounding;
    # comparing in float64 against finfo.max / tiny decides it without building a tensor)
    fi = torch.finfo(acc)
    if not fi.tiny <= 1.0 / t <= fi.max:
        raise ValueError(f"temperature: expected a number whose reciprocal is a finite normal "
                         f"number in {acc} (from {1.0 / fi.max:.3g} to {1.0 / fi.tiny:.3g}), "
                         f"got {value!r}")
    return t


def align_tokens(tokens, x, x_name, last):
    """tokens [B, T] (or [N]) against x [B, T, last], [B, T + 1, last] or [N, last] (the
    logits, or the hidden states): (x as [B, Tl, last], tokens [B, T], flat)."""
    tensor("tokens", tokens, integer=True)
    same_device("tokens", tokens, x_name, x)
    flat = x.dim() == 2
    if flat:
        if tokens.dim() != 1 or tokens.shape[0] != x.shape[0]:
            raise ValueError(f"tokens: with {x_name} [N, {last}] = {list(x.shape)} expected "
                             f"tokens [N] = [{x.shape[0]}], got {list(tokens.shape)}")
        x, tokens = x.unsqueeze(0), tokens.unsqueeze(0)
    if tokens.dim() != 2 or tokens.shape[0] != x.shape[0] or \
            x.shape[1] not in (tokens.shape[1], tokens.shape[1] + 1):
        raise ValueError(f"tokens: expected [B, T] matching {x_name} [B, T, {last}] or "
                         f"[B, T + 1, {last}] = {list(x.shape)}, got {list(tokens.shape)}")
    return x, tokens, flat


def logits_and_tokens(logits, tokens):
    """Validates logits/tokens and returns (logits3 [B, Tl, V], tokens2 [B, T] int64, flat).

    logits may be [B, T, V] or [B, T + 1, V] with tokens [B, T], or [N, V] with tokens [N]
    (flat=True: outputs are squeezed back). Batch/time strides are kept (no copy); only a
    last dimension that is not contiguous is copied.
    """
    tensor("logits", logits)
    if logits.dtype not in LOGITS_DTYPES:
        raise TypeError(f"logits: expected float32, bfloat16, float16 or float64, got {logits.dtype}")
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits: expected [B, T, V], [B, T + 1, V] or [N, V], got shape "
                         f"{list(logits.shape)}")
    logits, tokens, flat = align_tokens(tokens, logits, "logits", "V")
    if logits.shape[2] == 0:
        raise ValueError("logits: empty vocabulary (V = 0)")
    if logits.stride(2) != 1:  # the kernels read rows with unit stride
        if logits.shape[2] == 1:  # torch calls such a tensor contiguous whatever the stride
            logits = logits.as_strided(logits.shape, (*logits.stride()[:2], 1))
        else:
            logits = logits.contiguous()
    return logits, tokens.long().contiguous(), flat  # [B, T]: kernels index it flat


def response_mask(mask, like, flat, like_name="tokens"):
    """bool [B, T] of the shape and device of ``like`` (named like_name in messages);
    None means every position is valid."""
    if mask is None:
        return torch.ones_like(like, dtype=torch.bool)
    tensor("response_mask", mask)
    same_device("response_mask", mask, like_name, like)
    if flat:
        mask = mask.unsqueeze(0) if mask.dim() == 1 else mask
    if mask.shape != like.shape:
        raise ValueError(f"response_mask: expected shape {list(like.shape[1:] if flat else like.shape)},"
                         f" got {list(mask.shape[1:] if flat else mask.shape)}"
                         f"{_aligned_hint(mask, like, like_name)}")
    if mask.dtype == torch.bool and mask.is_contiguous():
        return mask  # (as it is: nothing writes into it)
    return (mask != 0).contiguous()  # != keeps the input's strides; kernels index flat


def rows_disjoint(x):
    """Whether no two elements of x share memory, decided from the strides alone: sorted by
    stride, each dimension of more than one entry must step past everything the smaller
    ones span (a sufficient condition; a slice such as logits[:, :-1] passes, an expanded
    or overlapping as_strided view does not)."""
    span = 0
    for size, stride in sorted(((n, st) for n, st in zip(x.shape, x.stride()) if n > 1),
                               key=lambda d: d[1]):
        if stride <= span:
            return False
        span += (size - 1) * stride
    return True


def host_readable(x):
    """Whether reading x's values costs nothing: a CPU tensor outside of tracing. A device
    tensor's value read would stall the host and break CUDA-graph capture, under
    torch.compile it would break the graph (under torch.func, read plain(x))."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def plain(x):
    """x without torch.func's wrappers: under vmap, the whole batch (the values a check on
    the host reads)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    return x


def token_range(tokens, mask, vocab):
    """Out-of-range ids on valid positions are an error (masked ones are never read).
    Returns the tokens to hand to the kernel.

    On CPU tensors the values are host memory: a ValueError names the first bad position.
    On a device (and under torch.compile, where a data-dependent branch would break the
    graph) reading them would stall the host and break CUDA-graph capture, so the check is
    an asynchronous device assertion (a RuntimeError naming `tokens`), and the bad ids are
    replaced by 0 so that no kernel can read out of bounds before it fires.
    """
    bad = mask & ((tokens < 0) | (tokens >= vocab))
    if not host_readable(tokens):
        torch._assert_async(~bad.any(), f"tokens: ids must lie in [0, {vocab}) on valid "
                                        "positions")
        return torch.where(bad, 0, tokens)
    bad, ids = plain(bad), plain(tokens)
    if bool(bad.any()):
        idx = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(f"tokens: ids must lie in [0, {vocab}) on valid positions; got "
                         f"{int(ids[tuple(idx)])} at position {idx}")
    return tokens


def count(name, value, like, dtype):
    """A positive denominator (global_num_tokens, global_num_seqs): a number, or a 0-d
    tensor (e.g. an all-reduced count, left on its device: no host read). Returns a float
    or a 0-d tensor of dtype on like's device. A tensor's value is checked on the host
    when that is free (CPU), else by an asynchronous device assertion."""
    if not isinstance(value, torch.Tensor):
        return positive_in(name, value, dtype)
    if value.numel() != 1 or value.dim() > 1:
        raise ValueError(f"{name}: expected a number or a 0-d tensor, got a tensor of shape "
                         f"{list(value.shape)}")
    if value.dtype == torch.bool or value.dtype.is_complex:
        raise TypeError(f"{name}: expected a real number, got a {value.dtype} tensor")
    same_device(name, value, "logits", like)
    v = value.detach().reshape(()).to(dtype)
    if host_readable(v):
        if not (math.isfinite(float(v)) and float(v) > 0):
            raise ValueError(f"{name}: expected a finite number > 0, got {float(v)!r}")
    else:
        torch._assert_async(torch.isfinite(v) & (v > 0), f"{name}: expected a finite number > 0")
    return v


def _aligned_hint(x, like, like_name):
    """The likely cause when a [B, T] input meets tokens of one more position."""
    if like_name == "tokens" and x.dim() == 2 and like.dim() == 2 and \
            tuple(x.shape) == (like.shape[0], like.shape[1] - 1):
        return (" (tokens [B, T + 1] were taken as aligned with logits [B, T + 1, V]: pass the "
                "T sampled tokens, tokens[:, 1:] of the full sequence, with the raw logits)")
    return ""


def per_token(name, x, like, flat, dtype, *, optional=False, like_name="tokens",
              per_seq_ok=False):
    """A [B, T] float tensor of the shape and device of ``like`` (named like_name in
    messages), converted to the accumulation dtype. per_seq_ok: a per-sequence [B] or
    [B, 1] tensor is accepted too and broadcast over the tokens (advantages of GRPO)."""
    if x is None:
        if optional:
            return None
        raise TypeError(f"{name}: expected a tensor, got None")
    tensor(name, x, floating=True)
    same_device(name, x, like_name, like)
    given = list(x.shape)  # (what the message shows: the caller's shape, not a reshape's)
    if x.shape != like.shape:  # (the usual case first: the shapes of the tokens)
        if flat and x.dim() == 1:
            x = x.unsqueeze(0)
        elif per_seq_ok and not flat and x.shape in ((like.shape[0],), (like.shape[0], 1)):
            x = x.reshape(like.shape[0], 1).expand(like.shape)
    if x.shape != like.shape:
        shown = like.shape[1:] if flat else like.shape
        raise ValueError(f"{name}: expected shape {list(shown)}, got {given}"
                         f"{'' if flat else _aligned_hint(x, like, like_name)}")
    # inputs from the rollout: they are data, not parameters, and get no gradient on any
    # backend (detached only where they would: a detach costs a new tensor per call)
    if x.requires_grad:
        x = x.detach()
    return (x if x.dtype == dtype else x.to(dtype)).contiguous()


def detached(t):
    """t without autograd history: t itself where it has none (the kernels' per-token
    outputs are non-differentiable already), since a detach costs a new tensor per call.
    Traced, always detached: torch.jit.trace's check re-runs the call under no_grad and
    wants the same graph."""
    return t.detach() if t.requires_grad or torch.jit.is_tracing() else t


def acc_dtype(x):
    """float64 inputs keep float64 (gradcheck); everything else accumulates in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
