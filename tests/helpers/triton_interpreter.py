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

test_triton_interpreter_fast_path.py checks that kernels give the same bits either way."""

import inspect

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
    it._ppo_kernels_fast_path = (patch_lang, launch, np_dtype,
                                 tensor_init and tensor_init[0])
    return True


def uninstall():
    """Puts Triton's own functions back (the check that compares both paths)."""
    from triton.runtime import interpreter as it

    saved = getattr(it, "_ppo_kernels_fast_path", None)
    if saved:
        import triton.language as tl

        it._patch_lang, it.GridExecutor.__call__, np_dtype, tensor_init = saved
        if np_dtype is not None:
            it._get_np_dtype = np_dtype
        if tensor_init is not None:
            tl.tensor.__init__ = tensor_init
        del it._ppo_kernels_fast_path
