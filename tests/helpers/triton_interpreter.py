"""A faster Triton interpreter for the test suite (TRITON_INTERPRET=1, no GPU): the same
execution, without the re-patching of triton.language at every device-function call.

Triton's interpreter (triton/runtime/interpreter.py) swaps the language's builtins for
numpy ones when a kernel launches (GridExecutor.__call__ -> _patch_lang, undone when the
launch ends), and again at each call of a @triton.jit helper inside the kernel
(InterpretedFunction.__call__ -> _patch_lang, never undone). The second patch finds the
builtins already swapped (a swapped member is no longer a builtin, so it is skipped) but
still scans every member of triton.language, its tensor class and its math module with
inspect.getmembers: about 2 ms a call, more than half of an interpreted kernel's time here
(cProfile of ppo_loss forward + backward). install() skips that second patch when the
running launch already patched every language module the helper can see, and changes
nothing else; the launch's own patch and its restore stay Triton's. Where the interpreter
does not have this shape (another Triton release), install() leaves it alone.

Two memos more, each a pure function of a Triton type (cProfile of a fused loss forward +
backward: each about a sixth of the interpreter's time; with both, the suite's Triton cases
took 798 s of test time where they took 1,241, 2026-12-07):
- the interpreter's _get_np_dtype builds a dict of 20 Triton types (20 hashes) at every
  call, to map one type to its numpy dtype: it is asked once per op;
- triton.language.tensor.__init__ wraps each dimension of the type's shape, and the element
  count, in new constexpr objects for every op's result: the memo hands each tensor of a
  type the same (immutable) ones. It is put in place only where the release's __init__ sets
  exactly the attributes the memo sets, to the same values (checked when installing).
Both key on the type's class and name (which spells the element type, the block shape and
the pointee).

One shortcut more: the interpreter's semantic.binary_op_type_checking_impl (the promotion
and broadcast rules every +, -, *, /, comparison and where goes through) answers the common
cases (operands of one element type, a pointer and an integer offset, a tensor and a Python
number of a lower kind) without its promotion tables, and hands the rest to Triton's. It is
set on the interpreter's own semantic object only (the compiler's is another), and only
where the release's function gives the same operands on a grid of probes (every element
type pair, pointers, block and scalar shapes, Python numbers at the edges of their kinds,
division or not). A fused loss forward + backward then takes 0.72x the CPU time (B 2, T 7,
V 257, process time) and the suite's Triton cases 532 s of test time where they took 798
(2026-12-07).

test_triton_interpreter_fast_path.py checks that kernels give the same bits either way."""

import inspect

import numpy as np

_STATE = {"depth": 0, "patched": frozenset()}
_LANGS = {}  # fn -> its _langs (a module's imports do not change once the kernels run)


def _langs(fn, tl):
    """The language modules visible from fn's globals, as the interpreter picks them."""
    langs = _LANGS.get(fn)
    if langs is None:
        langs = _LANGS[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                       if inspect.ismodule(v) and v in (tl, tl.core))
    return langs


def _memo(fn):
    """fn(type_) memoised by the type's name (a Triton type's name spells all of it: the
    element type, the block shape, the pointee), which hashes and compares as a string."""
    found = {}

    def memo(type_):
        key = (type(type_), type_.name)
        try:
            return found[key]
        except KeyError:
            found[key] = value = fn(type_)
            return value
    return memo


def _tensor_init(tl):
    """A memoised triton.language.tensor.__init__, or None where the release's own does not
    set exactly (handle, shape, numel, type, dtype) as it is written to here."""
    init = tl.tensor.__init__

    @_memo
    def parts(type_):
        t = object.__new__(tl.tensor)
        init(t, None, type_)
        return t.shape, t.numel, t.dtype

    def fast_init(self, handle, type_):
        self.shape, self.numel, self.dtype = parts(type_)
        self.handle = handle
        self.type = type_

    for type_ in (tl.block_type(tl.float32, [4, 8]), tl.int64):
        mine, theirs = object.__new__(tl.tensor), object.__new__(tl.tensor)
        init(theirs, "h", type_)
        fast_init(mine, "h", type_)
        if (sorted(vars(mine)) != sorted(vars(theirs))
                or any(repr(v) != repr(vars(theirs)[k]) for k, v in vars(mine).items())):
            return None
    return init, fast_init


def _binary_operands(tl, semantic):
    """A shortcut for the interpreter's semantic.binary_op_type_checking_impl (each +, -, *, /,
    comparison and where of a kernel goes through it, about half an interpreted kernel's time),
    or None where the release's own does not give the same operands on the probes below.

    The common cases get the same tensors the release's function returns, without its
    promotion tables (every other case goes to it):
    - two tensors of one element type, not pointers, and no float16 / bfloat16 division
      (which Triton computes in float32): the usual arithmetic conversions change nothing,
      so the operands are only broadcast to one shape;
    - a pointer and a signed integer tensor, where the pointer is allowed on its side: no
      conversion either, only the broadcast;
    - a float32 / float64 / int32 / int64 tensor and a Python number of a lower or equal
      kind (a float for the floats; an int of int32's range for all four, not a bool): the
      number does not take part in the promotion, so it becomes a constant of the tensor's
      element type, splat to the tensor's shape."""
    theirs = semantic.binary_op_type_checking_impl
    broadcast = semantic.broadcast_impl_value
    half = (tl.float16, tl.bfloat16)
    floats = (tl.float32, tl.float64)
    ints = (tl.int32, tl.int64)
    numeric = floats + ints

    def constant(number, like):
        c = semantic.scalar_constant(number, like.type.scalar)
        if like.type.is_block():
            return semantic.tensor(semantic.builder.create_splat(like.type.to_ir(semantic.builder),
                                                                 c.handle), like.type)
        return c

    def takes(number, scalar):
        """Whether a Python number keeps out of the promotion with a tensor of this type."""
        if type(number) is float:
            return scalar in floats
        return type(number) is int and -2**31 <= number < 2**31 and scalar in numeric

    def mine(lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False, arithmetic_check=True,
             div_or_mod=False):
        if arithmetic_check:
            lt, rt = type(lhs), type(rhs)
            if lt is tl.tensor and rt is tl.tensor:
                ls, rs = lhs.type.scalar, rhs.type.scalar
                if ls == rs and not ls.is_ptr() and not (div_or_mod and ls in half):
                    return broadcast(lhs, rhs)
                if (allow_lhs_ptr and ls.is_ptr() and rs in ints
                        or allow_rhs_ptr and rs.is_ptr() and ls in ints):
                    return broadcast(lhs, rhs)
            elif lt is tl.tensor and takes(rhs, lhs.type.scalar):
                return lhs, constant(rhs, lhs)
            elif rt is tl.tensor and takes(lhs, rhs.type.scalar):
                return constant(lhs, rhs), rhs
        return theirs(lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)

    def outcome(*args):
        try:
            return [(t.type, t.handle.data.tobytes()) for t in args[0](*args[1:])]
        except Exception as e:  # noqa: BLE001 (the same refusal is part of the same outcome)
            return type(e)

    try:
        from triton.runtime.interpreter import TensorHandle, _get_np_dtype

        scalars = (tl.float32, tl.float64, tl.float16, tl.bfloat16, tl.int32, tl.int64, tl.int1,
                   tl.uint32, tl.pointer_type(tl.float32), tl.pointer_type(tl.float64))
        # a block and a scalar of each, and for a float and a pointer a block of another
        # rank too (a broadcast that adds a dimension)
        shapes = (([4], [0, 1, 2, 3]), (None, [2]))
        ranked = (tl.float32, tl.pointer_type(tl.float32))
        probes = [tl.tensor(TensorHandle(np.array(v, _get_np_dtype(scalar)), scalar), ty)
                  for scalar in scalars
                  for shape, v in shapes + ((([1, 4], [[0, 1, 2, 3]]),) if scalar in ranked
                                            else ())
                  for ty in (tl.block_type(scalar, shape) if shape else scalar,)]
        numbers = (0.5, 0.0, 3, -7, 1e300, 2**31 - 1, 2**31, -2**31 - 1, 2**64, True)
        pairs = [(x, y) for x in probes for y in probes]
        pairs += [p for x in probes for n in numbers for p in ((x, n), (n, x))]
        with np.errstate(over="ignore"):  # (1e300 into float32 is inf, as on a device)
            for pair in pairs:
                ptr = any(isinstance(v, tl.tensor) and v.type.scalar.is_ptr() for v in pair)
                for flags in ((False, False), (True, True), (True, False))[:3 if ptr else 1]:
                    for div in (False, True):
                        if outcome(theirs, *pair, *flags, True, div) != \
                                outcome(mine, *pair, *flags, True, div):
                            return None
    except Exception:  # noqa: BLE001 (another release's types or builder: keep Triton's)
        return None
    return theirs, mine


def install():
    """Installs the fast path into triton.runtime.interpreter; True when it is in place."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as it
    except ImportError:
        return False
    if getattr(it, "_ppo_kernels_fast_path", False):
        return True
    needed = ("_patch_lang", "GridExecutor", "_LangPatchScope", "InterpretedFunction")
    if not all(hasattr(it, n) for n in needed):
        return False
    patch_lang, launch = it._patch_lang, it.GridExecutor.__call__

    def fast_patch_lang(fn):
        if _STATE["depth"]:
            langs = _langs(fn, tl)
            if langs <= _STATE["patched"]:
                return it._LangPatchScope()  # nothing to undo: the launch's patch holds
            scope = patch_lang(fn)
            _STATE["patched"] = _STATE["patched"] | langs
            return scope
        return patch_lang(fn)

    def fast_launch(self, *args, **kwargs):
        outer = _STATE["patched"]
        _STATE["depth"] += 1
        _STATE["patched"] = frozenset()
        try:
            return launch(self, *args, **kwargs)
        finally:
            _STATE["depth"] -= 1
            _STATE["patched"] = outer

    it._patch_lang = fast_patch_lang
    it.GridExecutor.__call__ = fast_launch
    np_dtype = getattr(it, "_get_np_dtype", None)
    if np_dtype is not None:
        it._get_np_dtype = _memo(np_dtype)
    tensor_init = _tensor_init(tl)
    if tensor_init is not None:
        tl.tensor.__init__ = tensor_init[1]
    semantic = getattr(it, "interpreter_semantic", None)
    operands = semantic is not None and _binary_operands(tl, semantic)
    if operands:
        semantic.binary_op_type_checking_impl = operands[1]  # this instance's only
    it._ppo_kernels_fast_path = (patch_lang, launch, np_dtype,
                                 tensor_init and tensor_init[0], bool(operands))
    return True


def uninstall():
    """Puts Triton's own functions back (the check that compares both paths)."""
    from triton.runtime import interpreter as it

    saved = getattr(it, "_ppo_kernels_fast_path", None)
    if saved:
        import triton.language as tl

        it._patch_lang, it.GridExecutor.__call__, np_dtype, tensor_init, operands = saved
        if operands:
            del it.interpreter_semantic.binary_op_type_checking_impl  # the class's again
        if np_dtype is not None:
            it._get_np_dtype = np_dtype
        if tensor_init is not None:
            tl.tensor.__init__ = tensor_init
        del it._ppo_kernels_fast_path
