"""setup.py's build knowledge (toolkit discovery, the CUDA version check, the default arch
list, MAX_JOBS, isolated builds) and the installed metadata. Fast: nothing is compiled.
The setup.py cases need the source checkout and are skipped when the tests run against an
installed copy (scripts/check_install.sh runs them from the checkout first)."""

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP = os.path.join(ROOT, "setup.py")
needs_checkout = pytest.mark.skipif(not os.path.isfile(SETUP),
                                    reason="needs the source checkout's setup.py")


@pytest.fixture(scope="module")
def setup_py():
    if not os.path.isfile(SETUP):
        pytest.skip("needs the source checkout's setup.py")
    spec = importlib.util.spec_from_file_location("ppo_kernels_setup", SETUP)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # definitions only: main() runs under __main__
    return mod


def real_nvcc():
    """The nvcc of a real toolkit here (e.g. /usr/local/cuda-13.0/bin/nvcc), else None."""
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return os.path.join(os.path.realpath(home), "bin", "nvcc")
    return None


def fake_torch(version, cuda):
    return types.SimpleNamespace(__version__=version, version=types.SimpleNamespace(cuda=cuda))


def run_setup(tmp_path, modules, pathdir="path", argv="bdist_wheel"):
    """Runs setup.py as pip would, with stand-in `modules` ({file: source}) in
    tmp_path/pathdir first on the path: setup.py stops before it compiles anything."""
    site = tmp_path / pathdir
    for name, src in modules.items():
        f = site / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(textwrap.dedent(src))
    env = dict(os.environ, PYTHONPATH=str(site))
    code = (f"import sys, runpy; sys.argv = ['setup.py', {argv!r}]; "
            f"runpy.run_path({SETUP!r}, run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


@needs_checkout
def test_isolated_build_without_torch_is_explained(tmp_path):
    # an isolated build environment: setuptools, no torch (pyproject.toml lists none)
    r = run_setup(tmp_path, {"torch/__init__.py": "raise ImportError('no torch here')"})
    assert r.returncode != 0
    for needle in ("torch is not importable", "isolated", "pip install --no-build-isolation",
                   "uv pip install --no-build-isolation", "--no-isolation"):
        assert needle in r.stderr, (needle, r.stderr)


@needs_checkout
def test_isolated_build_with_its_own_torch_is_explained(tmp_path):
    # pip's isolated environment, which got a torch of its own (another version)
    r = run_setup(tmp_path, {"torch/__init__.py": "__version__ = '9.9.0+cu999'\n"},
                  pathdir="pip-build-env-x/overlay")
    assert r.returncode != 0
    assert "isolated build (torch 9.9.0+cu999" in r.stderr, r.stderr
    assert "require torch==9.9.0" in r.stderr and "--no-build-isolation" in r.stderr


@needs_checkout
def test_too_old_torch_is_refused(tmp_path, setup_py):
    r = run_setup(tmp_path, {"torch.py": "__version__ = '2.1.0+cpu'\n"})
    assert r.returncode != 0
    oldest = ".".join(map(str, setup_py.OLDEST_TORCH))
    assert f"torch 2.1.0+cpu is older than the oldest supported torch {oldest}" in r.stderr


@needs_checkout
def test_too_old_setuptools_is_refused(tmp_path):
    r = run_setup(tmp_path, {"setuptools/__init__.py": "__version__ = '65.5.0'\n"})
    assert r.returncode != 0
    assert "setuptools 65.5.0 is too old" in r.stderr and "setuptools>=77" in r.stderr


def test_isolated_markers(setup_py):
    assert setup_py.isolated_markers("/tmp/pip-build-env-abc/overlay/lib/site-packages")
    assert setup_py.isolated_markers("/tmp/build-env-x1y2/lib/python3.11/site-packages")
    assert setup_py.isolated_markers("/root/.cache/uv/builds-v0/.tmpAbC/lib")
    assert not setup_py.isolated_markers("/tmp/venv-user/lib/python3.11/site-packages")


def test_nvcc_wrapper_script_is_followed_to_the_toolkit(setup_py, tmp_path):
    nvcc = real_nvcc()
    if nvcc is None:
        pytest.skip("no CUDA toolkit here")
    wrapper = tmp_path / "bin" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {nvcc} "$@"\n')
    wrapper.chmod(0o755)
    home = os.path.dirname(os.path.dirname(nvcc))
    assert os.path.realpath(setup_py.nvcc_home(str(wrapper))) == os.path.realpath(home)
    assert setup_py.is_toolkit(home) and not setup_py.is_toolkit(str(tmp_path))


@pytest.fixture
def wrapper_on_path(setup_py, tmp_path, monkeypatch):
    """Only a wrapper script `nvcc` on PATH (as /usr/local/bin/nvcc is on the build
    machines), no CUDA_HOME."""
    nvcc = real_nvcc()
    if nvcc is None:
        pytest.skip("no CUDA toolkit here")
    bindir = tmp_path / "wrapbin"
    bindir.mkdir()
    (bindir / "nvcc").write_text(f'#!/bin/sh\nexec {nvcc} "$@"\n')
    (bindir / "nvcc").chmod(0o755)
    for var in ("CUDA_HOME", "CUDA_PATH", "PPO_KERNELS_NO_CUDA"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    return os.path.dirname(os.path.dirname(nvcc)), setup_py.nvcc_version(nvcc)


def test_find_cuda_takes_the_wrapped_toolkit(setup_py, wrapper_on_path):
    home, ver = wrapper_on_path
    t = fake_torch(f"2.14.1+cu{ver[0]}{ver[1]}", f"{ver[0]}.{ver[1]}")
    found, reason = setup_py.find_cuda(t)
    assert reason is None and os.path.realpath(found) == os.path.realpath(home)


def test_find_cuda_without_a_matching_toolkit_builds_cpu_only(setup_py, wrapper_on_path,
                                                             capsys):
    home, ver = wrapper_on_path
    other = ver[0] - 1
    found, reason = setup_py.find_cuda(fake_torch(f"2.6.0+cu{other}4", f"{other}.4"))
    assert found is None
    assert f"needs a CUDA {other}.x toolkit" in reason and f"nvcc {ver[0]}.{ver[1]}" in reason
    err = capsys.readouterr().err
    assert "building without CUDA kernels" in err and "Triton backend" in err


def test_find_cuda_cpu_only_torch_and_switch(setup_py, monkeypatch):
    monkeypatch.delenv("PPO_KERNELS_NO_CUDA", raising=False)
    assert setup_py.find_cuda(fake_torch("2.13.0+cpu", None)) == (
        None, "torch 2.13.0+cpu is a CPU-only build")
    monkeypatch.setenv("PPO_KERNELS_NO_CUDA", "1")
    assert setup_py.find_cuda(fake_torch("2.14.1+cu130", "13.0")) == (
        None, "PPO_KERNELS_NO_CUDA=1")


def test_cuda_home_that_is_no_toolkit_is_an_error(setup_py, monkeypatch, tmp_path):
    monkeypatch.delenv("PPO_KERNELS_NO_CUDA", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    with pytest.raises(SystemExit, match="is not a CUDA toolkit"):
        setup_py.find_cuda(fake_torch("2.14.1+cu130", "13.0"))


def test_max_jobs_fits_cores_and_memory(setup_py):
    jobs, cores, avail = setup_py.max_jobs()
    assert 1 <= jobs <= cores
    if avail is not None and avail >= setup_py.GIB_PER_JOB << 30:
        assert jobs * (setup_py.GIB_PER_JOB << 30) <= avail


@pytest.mark.parametrize("avail_gib,jobs,want", [(None, 2, 4), (22.7, 2, 4), (12.5, 2, 3),
                                                 (5.0, 2, 1), (0.5, 1, 1), (300, 64, 2)])
def test_parallel_builds_fit_the_memory(setup_py, monkeypatch, avail_gib, jobs, want):
    """The extensions compile side by side (a ninja of jobs jobs each) as far as the memory
    holds GIB_PER_JOB for every job of every one; never fewer than one at a time."""
    avail = None if avail_gib is None else int(avail_gib * 2**30)
    monkeypatch.setattr(setup_py, "max_jobs", lambda: (jobs, jobs, avail))
    assert setup_py.parallel_builds(4, jobs) == want


def installed_wheel():
    """The installed ppo-kernels distribution (a wheel, maybe editable), else skip (a
    source tree on sys.path, or its ppo_kernels.egg-info)."""
    try:
        dist = importlib.metadata.distribution("ppo-kernels")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is None or dist.read_text("WHEEL") is None:
        pytest.skip("ppo-kernels is not installed from a wheel here")
    return dist


def test_installed_metadata_pins_the_torch_it_was_built_for():
    reqs = installed_wheel().requires or []
    torch_reqs = [r for r in reqs if r.replace(" ", "").startswith("torch")]
    assert torch_reqs == [f"torch=={torch.__version__.split('+')[0]}"], reqs


def test_no_top_level_module_but_ppo_kernels():
    """The distribution installs the ppo_kernels package only (its Triton kernels are the
    ppo_kernels.triton_kernels subpackage: nothing another package could shadow)."""
    files = installed_wheel().files or []
    tops = {f.parts[0] for f in files if not f.parts[0].endswith((".dist-info", ".pth"))
            and f.parts[0] not in ("..", "__pycache__")
            and not f.parts[0].startswith("__editable__")}
    assert tops <= {"ppo_kernels"}, tops


def test_build_progress_reaches_the_terminal_under_pip(setup_py, monkeypatch, capsys):
    """pip captures a build's stderr (shown only with -v or on failure): each compile step
    also goes to the terminal the install runs in, /dev/tty, and only to stderr without
    one (CI)."""
    written = []

    class Tty:
        def __init__(self, path, mode):
            assert (path, mode) == ("/dev/tty", "w")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, text):
            written.append(text)

    monkeypatch.setattr(setup_py, "open", Tty, raising=False)
    setup_py.progress("compiling ppo_kernels._C")
    assert written == ["ppo_kernels setup: compiling ppo_kernels._C\n"]
    assert "compiling ppo_kernels._C" in capsys.readouterr().err

    def no_tty(path, mode):
        raise OSError("no controlling terminal")

    monkeypatch.setattr(setup_py, "open", no_tty, raising=False)
    setup_py.progress("done")
    assert "ppo_kernels setup: done" in capsys.readouterr().err


@pytest.fixture
def fake_cxx(tmp_path, monkeypatch):
    """A stand-in C++ compiler (CXX): answers GCC's predefined macros (or clang's with
    FAKE_CLANG=1), logs each compile, writes its -o file, fails with FAKE_FAIL=1."""
    log = tmp_path / "cxx.log"
    cxx = tmp_path / "c++"
    cxx.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case "$*" in
          *-dM*) echo "#define __GNUC__ 13"; [ "$FAKE_CLANG" = 1 ] && echo "#define __clang__ 1"
                 exit 0;;
        esac
        echo "$*" >> {log}
        [ "$FAKE_FAIL" = 1 ] && {{ echo "cc1plus: fatal error" >&2; exit 1; }}
        while [ $# -gt 0 ]; do [ "$1" = -o ] && echo gch > "$2"; shift; done
        """))
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    return log


def pch_ext(header, flags=("-O3",)):
    return types.SimpleNamespace(
        name="ppo_kernels._cpu_avx2", define_macros=[], include_dirs=["/inc"],
        extra_compile_args={"cxx": [*flags, "-include", str(header), "-DX=1"]})


@needs_checkout
def test_precompiled_headers_rebuilt_only_when_stale(setup_py, fake_cxx, tmp_path):
    """The torch headers are precompiled with the flags the module's files compile with
    (minus the -include of the header itself), once: again only when the command or the
    header's text changes, which also rewrites the copy the files include (its mtime makes
    ninja recompile them)."""
    compiler = types.SimpleNamespace(compiler_so=["gcc", "-fPIC", "-O2"])
    header = tmp_path / "pch" / "torch_headers.h"
    setup_py.precompile_headers(compiler, pch_ext(header))
    calls = fake_cxx.read_text().splitlines()
    assert len(calls) == 1
    assert "-x c++-header -c " + str(header) + " -o " + str(header) + ".gch" in calls[0]
    assert "-include" not in calls[0] and "-I/inc" in calls[0] and "-DX=1" in calls[0]
    assert "-fPIC -O2" in calls[0] and calls[0].endswith("-O3 -DX=1")
    src = open(os.path.join(ROOT, setup_py.PCH_HEADER)).read()
    assert header.read_text() == src and (tmp_path / "pch" / "torch_headers.h.gch").is_file()

    setup_py.precompile_headers(compiler, pch_ext(header))
    assert len(fake_cxx.read_text().splitlines()) == 1  # up to date: nothing run
    setup_py.precompile_headers(compiler, pch_ext(header, flags=("-O3", "-mavx2")))
    assert len(fake_cxx.read_text().splitlines()) == 2  # other flags: precompiled again


@needs_checkout
@pytest.mark.parametrize("why", ["FAKE_CLANG", "FAKE_FAIL"])
def test_precompiled_headers_fall_back_to_text(setup_py, fake_cxx, tmp_path, monkeypatch,
                                               capsys, why):
    """Another compiler than GCC, or a failed precompile: no .gch, the copy of the header
    is there to be included as plain text (slower, the same code), and the build says so;
    the next build leaves the copy as it is (its mtime: ninja recompiles nothing for it)."""
    monkeypatch.setenv(why, "1")
    header = tmp_path / "pch" / "torch_headers.h"
    compiler = types.SimpleNamespace(compiler_so=["gcc"])
    took = setup_py.precompile_headers(compiler, pch_ext(header))
    assert took == 0.0 and header.is_file()
    assert not (tmp_path / "pch" / "torch_headers.h.gch").exists()
    assert ("is not GCC" if why == "FAKE_CLANG" else "failed") in capsys.readouterr().err
    written = header.stat().st_mtime_ns
    os.utime(header, ns=(written - 10**9, written - 10**9))  # (a second older)
    setup_py.precompile_headers(compiler, pch_ext(header))
    assert header.stat().st_mtime_ns == written - 10**9
