"""The fixtures, hooks and markers of the ppo_kernels test suite; the shared helpers are in
tests/helpers/ (backends, inputs, asserts, raw_ops, bad_inputs, ranks, child).

Test files import the helpers as ``from helpers.<module> import ...``: tests/ has no
__init__.py, so pytest puts this directory on sys.path. The test files are named for the
module they test (tests/test_<module>[_<aspect>].py); the *_cases.py scripts are the
multi-process tests' rank scripts (helpers/ranks.py); tests/gpu/ holds the GPU device
checks that benchmarks/gpu_check.sh runs (no pytest files).
"""

import os
import zlib

import pytest
import torch
import torch.distributed as dist

# first: it sets TRITON_INTERPRET=1 (no GPU) before anything imports triton
from helpers.backends import BACKENDS
from helpers.ranks import free_port, run_ranks

# Hypothesis profiles (docs/TESTING.md): "ci", the default, is derandomized (the same
# examples every run: CI cannot flake on a new draw); HYPOTHESIS_PROFILE=random draws fresh
# examples each run, on demand, to look for new failures (then pin them with @example).
# The property tests' own @settings leave derandomize to the profile.
try:
    from hypothesis import settings as _hyp_settings
except ImportError:  # (hypothesis is a test dependency; tests without it still import)
    _hyp_settings = None
if _hyp_settings is not None:
    _hyp_settings.register_profile("ci", derandomize=True, deadline=None, database=None)
    _hyp_settings.register_profile("random", derandomize=False, deadline=None, database=None,
                                   print_blob=True)
    _hyp_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(params=BACKENDS)
def be(request):
    return request.param


@pytest.fixture
def seed(request):
    """A seed that differs per test and per parametrisation (derived from the node id),
    stable from run to run."""
    return zlib.crc32(request.node.nodeid.encode())


@pytest.fixture
def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def group1():
    """A 1-process gloo group, destroyed after the test."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", world_size=1, rank=0,
                            init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


def _uses_module_fixture(item):
    """Whether an item uses a module-scoped fixture (a launch of ranks, a script's run, a
    compiled kernel: what such a fixture holds is costly to make)."""
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(defs and defs[-1].scope == "module"
                                    for defs in info.name2fixturedefs.values())


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the marks into node ids
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist with --dist loadgroup, the tests that share a costly fixture go
    to one worker, so that it is made once, not once per worker: the session's one
    2-process launch (two_ranks) and each module's module-scoped fixtures (a worker that
    ran one test of tests/test_report.py ran its 87 s report script for itself). The
    grouped tests come first: each group is a long stretch on one worker, and started
    last one of them would end the run alone (xdist hands out work in this order)."""
    for item in items:
        if "two_ranks" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("two_ranks"))
        elif _uses_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    items.sort(key=lambda it: it.get_closest_marker("xdist_group") is None)  # (stable)


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory):
    """The results of tests/two_rank_cases.py on 2 gloo processes (one launch per session):
    a list of the ranks' {case: result} dicts."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "two_rank_cases.py")
    return run_ranks(script, tmp_path_factory.mktemp("tp2"))
