"""ppo_kernels/_extension.py: the compiled extension loads only under the torch it was
built for, and a broken, mismatched or missing build says what to do.

Each case runs `import ppo_kernels` in a fresh interpreter (the loader acts at import
time). A mismatched build is faked by putting a ppo_kernels._build_meta module that names
another torch into sys.modules before the import; a never-built or broken checkout is a
copy of the package's Python files in a temporary folder. Nothing is rebuilt.
"""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import ppo_kernels as pk
from ppo_kernels import _extension

PKG = os.path.dirname(os.path.abspath(pk.__file__))
RUNNING = dict(torch_version=torch.__version__, torch_cuda=torch.version.cuda,
               torch_cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI),
               python=f"{sys.version_info[0]}.{sys.version_info[1]}")


def run_py(code, cwd=None, path=None, env=None):
    """Runs code in a fresh interpreter; path: the folder ppo_kernels is imported from."""
    e = {k: v for k, v in os.environ.items() if k != "PPO_KERNELS_NO_EXTENSION"}
    e["PYTHONPATH"] = path = path or os.path.dirname(PKG)
    e.update(env or {})
    # `python -c` puts the working directory first on sys.path: never another checkout's
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd or path, env=e,
                          capture_output=True, text=True, timeout=120)


def fake_meta(**changes):
    """Code that installs a recorded build of the running torch with `changes` applied."""
    meta = dict(RUNNING, cuda=False, cpu_capabilities=["default"], **changes)
    return ("import sys, types\n"
            "m = types.ModuleType('ppo_kernels._build_meta')\n"
            f"m.BUILD = {meta!r}\n"
            "sys.modules['ppo_kernels._build_meta'] = m\n")


def expect_import_error(r, *needles):
    assert r.returncode != 0, r.stdout + r.stderr
    assert "\nImportError: ppo_kernels" in r.stderr, r.stderr  # not a crash, not another error
    for n in needles:
        assert n in r.stderr, (n, r.stderr)


@pytest.fixture
def checkout(tmp_path):
    """A source checkout that was never built: the package's .py files, setup.py, csrc/."""
    shutil.copytree(PKG, tmp_path / "ppo_kernels",
                    ignore=shutil.ignore_patterns("*.so", "_build_meta.py", "__pycache__"))
    (tmp_path / "setup.py").write_text("# stand-in\n")
    (tmp_path / "csrc").mkdir()
    return tmp_path


@pytest.mark.parametrize("field,value,shown", [
    ("torch_version", "2.0.0+fake", "torch 2.0.0+fake"),
    ("torch_cuda", "99.9", "CUDA 99.9"),
    ("torch_cxx11_abi", not RUNNING["torch_cxx11_abi"], "C++11 ABI"),
    ("python", "3.99", "Python 3.99"),
])
def test_mismatched_build_raises_import_error(field, value, shown):
    r = run_py(fake_meta(**{field: value}) + "import ppo_kernels\n")
    expect_import_error(r, "compiled against", shown, f"this is torch {torch.__version__}",
                        "pip install --no-build-isolation", "PPO_KERNELS_NO_EXTENSION=1")
    assert "undefined symbol" not in r.stderr


def test_mismatch_names_the_version_to_go_back_to():
    r = run_py(fake_meta(torch_version="2.0.0+fake") + "import ppo_kernels\n")
    expect_import_error(r, "pip install torch==2.0.0")


def test_mismatch_can_be_bypassed_for_the_torch_backend():
    r = run_py(fake_meta(torch_version="2.0.0+fake") + textwrap.dedent("""
        import ppo_kernels as pk
        info = pk.build_info()
        assert not info["built"] and info["backends"][-1] == "torch", info
        print("ok")
        """), env={"PPO_KERNELS_NO_EXTENSION": "1"})
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_never_built_checkout_imports_with_the_torch_backend(checkout, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("cwd")
    r = run_py("""
        import numpy as np, torch
        import ppo_kernels as pk
        from ppo_kernels import reference as ref
        info = pk.build_info()
        assert info["built"] is False and info["cpu"] is False and info["cuda"] is False
        assert "torch" in info["backends"] and "cpu" not in info["backends"], info
        assert "--no-build-isolation -e" in info["how_to_build"], info
        assert "not built" in info["load_error"], info
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(2, 5, 11, generator=g, dtype=torch.float64, requires_grad=True)
        tok = torch.randint(0, 11, (2, 4), generator=g)
        old = torch.randn(2, 4, generator=g, dtype=torch.float64) * 0.1 - 2
        adv = torch.randn(2, 4, generator=g, dtype=torch.float64)
        mask = torch.ones(2, 4, dtype=torch.bool)
        for backend in ("auto", "torch"):
            loss, _ = pk.ppo_loss(logits, tok, old, adv, mask, backend=backend)
            (grad,) = torch.autograd.grad(loss, logits)
            rl, _, rd = ref.ppo_loss(logits.detach().numpy(), tok.numpy(), old.numpy(),
                                     adv.numpy(), mask.numpy())
            assert abs(float(loss) - rl) < 1e-10, (float(loss), rl)
            assert np.abs(grad.numpy() - rd).max() < 1e-10
        try:
            pk.ppo_loss(logits, tok, old, adv, mask, backend="cpu")
        except ValueError as e:
            assert "not built" in str(e) and "--no-build-isolation" in str(e), e
        else:
            raise AssertionError("backend='cpu' without a build")
        print("ok", pk.__file__)
        """, cwd=elsewhere, path=str(checkout))
    assert r.returncode == 0, r.stderr
    assert f"ok {checkout / 'ppo_kernels' / '__init__.py'}" in r.stdout


def test_a_shadowed_build_is_named_and_auto_warns_once(checkout, tmp_path_factory):
    """Python run inside an unbuilt checkout imports it ahead of a built copy further down
    sys.path: build_info names both folders, and backend="auto" says once, in a warning,
    that it runs the eager composite and why (a silent fallback is about 10x slower)."""
    built = os.path.dirname(PKG)
    r = run_py("""
        import warnings, torch
        import ppo_kernels as pk
        info = pk.build_info()
        print("path", info["path"])
        print("elsewhere", info["built_elsewhere"])
        print("hint", info["how_to_build"])
        x = torch.randn(1, 3, 5, dtype=torch.float64)
        t = torch.zeros(1, 2, dtype=torch.long)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for backend in ("auto", "auto", "torch"):
                pk.ppo_loss(x, t, torch.zeros(1, 2), torch.ones(1, 2), backend=backend)
        print("warnings", len(w))
        print("warning", w[0].message if w else None)
        """, cwd=str(tmp_path_factory.mktemp("cwd")),
        path=os.pathsep.join([str(checkout), built]))
    assert r.returncode == 0, r.stderr
    out = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert out["path"] == str(checkout / "ppo_kernels")
    assert os.path.join(built, "ppo_kernels") in out["elsewhere"]
    assert "shadows the built copy" in out["hint"] and "outside the checkout" in out["hint"]
    assert out["warnings"] == "1"
    assert "eager PyTorch composite" in out["warning"] and "shadows" in out["warning"]


def test_build_info_names_its_folder():
    info = pk.build_info()
    assert info["path"] == PKG
    assert PKG not in info["built_elsewhere"]


def test_recorded_build_without_its_modules_is_reported(checkout):
    (checkout / "ppo_kernels" / "_build_meta.py").write_text(
        f"BUILD = {dict(RUNNING, cuda=False, cpu_capabilities=['default'])!r}\n")
    r = run_py("import ppo_kernels\n", path=str(checkout))
    expect_import_error(r, "does not load", "no _C module",
                        f"-m pip install --no-build-isolation -e {checkout}")


def test_unloadable_module_is_reported_not_crashed(checkout):
    """A compiled module that the dynamic loader refuses (here: not an ELF file at all; in
    the field an undefined symbol from another torch) is an ImportError that says how to
    rebuild, also without a recorded build (one made before setup.py recorded it)."""
    suffix = next(s for s in __import__("importlib.machinery").machinery.EXTENSION_SUFFIXES
                  if s.endswith(".so"))
    (checkout / "ppo_kernels" / f"_C{suffix}").write_bytes(b"not a shared object\n")
    r = run_py("import ppo_kernels\n", path=str(checkout))
    expect_import_error(r, "ppo_kernels._C does not load", "Rebuild it",
                        "--no-build-isolation -e")


def test_rebuild_command_for_an_installed_copy(monkeypatch):
    monkeypatch.setattr(_extension, "SOURCE_CHECKOUT", False)
    monkeypatch.setattr(_extension, "_installed_from", lambda: "git+https://example.org/x@abc")
    cmd = _extension.rebuild_command()
    assert cmd.startswith(sys.executable) and "--no-build-isolation --no-deps" in cmd
    assert cmd.endswith("git+https://example.org/x@abc")
    monkeypatch.setattr(_extension, "_installed_from", lambda: None)
    assert "<the ppo-kernels source" in _extension.rebuild_command()


def test_build_info_of_this_build():
    info = pk.build_info()
    assert info["torch"] == torch.__version__
    assert "torch" in info["backends"]
    if not info["built"]:
        pytest.skip(f"the extension is not built here: {info['load_error']}")
    assert info["cpu"] and "cpu" in info["backends"]
    if info["built_for_torch"] is not None:  # recorded by this setup.py
        assert info["built_for_torch"] == torch.__version__
        assert _extension.BUILD_META["torch_cuda"] == torch.version.cuda
        assert info["cuda"] == _extension.BUILD_META["cuda"]
        assert info["cuda"] or info["cuda_skipped"], info


# (the two tests below read the checkout's layout: not run against an installed wheel,
# whose ppo_kernels/triton_kernels is a plain subpackage, test_install.py)
checkout_only = pytest.mark.skipif(not _extension.SOURCE_CHECKOUT,
                                   reason="ppo_kernels is an installed copy, not a checkout")


@checkout_only
def test_checkout_finds_its_triton_sources_without_an_install():
    """Imported from the source tree alone (no installed or editable copy on the import
    path: the GPU check's in-place build), ppo_kernels.triton_kernels is the checkout's
    top-level triton_kernels/ (an install maps it there: pyproject.toml package-dir)."""
    r = run_py("""
        import sys
        # the editable install's finder removed: only the source tree on sys.path
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
        import importlib.util
        spec = importlib.util.find_spec("ppo_kernels.triton_kernels")
        print(spec.origin)
        print(importlib.util.find_spec("ppo_kernels.triton_kernels.library").origin)
    """)
    assert r.returncode == 0, r.stderr
    root = os.path.dirname(PKG)
    assert r.stdout.split() == [os.path.join(root, "triton_kernels", "__init__.py"),
                                os.path.join(root, "triton_kernels", "library.py")]


@checkout_only
def test_checkout_copy_imports_its_own_triton_sources(tmp_path):
    """A copy of the checkout imported through PYTHONPATH (scripts/mutate.py's mutants)
    gets the copy's triton_kernels/, not the one the editable install maps."""
    root = os.path.dirname(PKG)
    for d in ("ppo_kernels", "triton_kernels"):
        shutil.copytree(os.path.join(root, d), tmp_path / d,
                        ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    (tmp_path / "setup.py").write_text("# stand-in\n")
    (tmp_path / "csrc").mkdir()
    r = run_py("""
        import importlib.util
        print(importlib.util.find_spec("ppo_kernels.triton_kernels._math").origin)
    """, path=str(tmp_path), env={"PPO_KERNELS_NO_EXTENSION": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / "triton_kernels" / "_math.py")
