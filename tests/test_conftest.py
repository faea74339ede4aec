"""The suite's own scheduling (tests/conftest.py): under `make test` (pytest-xdist, --dist
loadgroup) the tests that share a module-scoped fixture carry their module's group in
their node id, which is how xdist keeps them on one worker, so that the fixture is made
once. A pytest whose node ids xdist cannot extend (9.2:
https://github.com/pytest-dev/pytest-xdist/issues/1386) fails this test instead of
silently making every costly fixture once per worker."""

import os

import pytest


@pytest.fixture(scope="module")
def made_once():
    return object()


def test_module_fixture_groups_reach_xdist(request, made_once):
    # (a worker's own --dist is "no"; xdist sets option.loadgroup there)
    if not os.environ.get("PYTEST_XDIST_WORKER") or not getattr(request.config.option,
                                                                 "loadgroup", False):
        pytest.skip("not under pytest-xdist --dist loadgroup (make test runs it there)")
    group = request.node.get_closest_marker("xdist_group")
    assert group is not None, "conftest.py did not group a test that uses a module fixture"
    assert request.node.nodeid.endswith("@" + group.args[0]), request.node.nodeid
