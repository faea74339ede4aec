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
    it._ppo_kernels_fast_path = (patch_lang, launch)
    return True


def uninstall():
    """Puts Triton's own functions back (the check that compares both paths)."""
    from triton.runtime import interpreter as it

    saved = getattr(it, "_ppo_kernels_fast_path", None)
    if saved:
        it._patch_lang, it.GridExecutor.__call__ = saved
        del it._ppo_kernels_fast_path
