"""Processes of their own: the one launcher of the multi-process tests (run_ranks), the
one runner of a rank script's cases (rank_main), a free port and the lock that keeps two
launches off the same cores.

A rank script (tests/*_cases.py) holds only its case functions and ends with
``rank_main(CASES)``; run_ranks runs it as ``python script RANK PORT OUT [ARGS]`` would, on
n processes, and returns each rank's OUT/rank<r>.json. The JSON carries every result back
(errors relative to the single-process op, messages), and the test files assert on them.

The ranks are forked from a fork server that imported torch once (multiprocessing's
"forkserver" start method, one server per test process): a rank then starts in a
fraction of a second instead of importing torch for itself (~4 s of CPU on a 2-core
machine, ~25 ranks in the suite). The server is single-threaded and has run no torch op,
so a forked rank starts as clean as a new interpreter (no OpenMP pool, no process group)."""

import contextlib
import dataclasses
import datetime
import fcntl
import functools
import gc
import json
import multiprocessing
import os
import runpy
import socket
import sys
import tempfile
import time
import traceback
import warnings


def _tail(path, n=4000):
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return "(no output)"


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now (the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def exclusive_cores():
    """Held while a test runs processes of its own (gloo ranks, torchrun): under
    pytest-xdist (`make test` runs `pytest -n auto`) one worker at a time launches them, so
    that the ranks of one test never share the cores with another worker's ranks (on 2
    cores, 4 ranks at once time out). The lock is the run's (xdist's run id), a file in the
    temporary folder."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", f"solo{os.getpid()}")
    path = os.path.join(tempfile.gettempdir(), f"ppo_kernels_tests_{run}.lock")
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_ranks(script, out, n=2, timeout=180, args=()):
    """Runs ``python script RANK PORT OUT *args`` as n processes and returns the ranks'
    OUT/rank<r>.json dicts, in rank order (one launch at a time over the xdist workers:
    exclusive_cores). A rank that exits non-zero fails the call with its stderr, and so
    does a case a rank recorded as "error: ..." (rank_main)."""
    with exclusive_cores():
        return _run_ranks(script, out, n, timeout, args)


@functools.cache
def _forkserver():
    """multiprocessing's fork-server context, torch preloaded (made once per process)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def _rank_process(script, argv, env, log):
    """One rank, in a process forked from the fork server: the script run as ``python
    script ARGV...`` runs it (``__main__``, its folder first on sys.path), with env set,
    torch's intra-op threads as OMP_NUM_THREADS says (the server read the variable
    before it was set) and stdout / stderr to the file log."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(env)
    if env.get("PYTHONWARNINGS") == "ignore":
        warnings.simplefilter("ignore")
    import torch

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def _run_ranks(script, out, n, timeout, args):
    env = dict(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WORLD_SIZE=str(n))
    port = str(free_port())
    ctx = _forkserver()
    logs = [os.path.join(str(out), f"rank{r}.log") for r in range(n)]
    procs = [ctx.Process(target=_rank_process, daemon=True,
                         args=(str(script), [str(r), port, str(out), *map(str, args)], env,
                               logs[r])) for r in range(n)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + timeout
        for r, p in enumerate(procs):
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                raise TimeoutError(f"rank {r} of {script} still running after {timeout} s: "
                                   + _tail(logs[r]))
            assert p.exitcode == 0, f"rank {r} exited with {p.exitcode}: " + _tail(logs[r])
    finally:
        for p in procs:  # (a rank left waiting in a collective)
            if p.is_alive():
                p.kill()
                p.join()
    ranks = []
    for r in range(n):
        with open(os.path.join(str(out), f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    # a case that raised (rank_main records it) fails the launch, named
    errors = [f"rank {r} {k}: {v[-3000:]}" for r, res in enumerate(ranks)
              for k, v in res.items() if isinstance(v, str) and v.startswith("error: ")]
    assert not errors, "\n".join(errors)
    return ranks


@dataclasses.dataclass
class Rank:
    """What a case function gets: this process's rank, the world size, the output folder,
    the script's extra arguments, and ``state`` (what rank_main's ``setup`` returned)."""

    rank: int
    world: int
    out: str
    args: list
    state: object = None


def case(name, fn, *args, **kwargs):
    """A case function whose one result is ``fn(*args, **kwargs)`` (bound now, run later),
    recorded under ``name`` (its error too, if it raises)."""
    def run(r):
        return {name: fn(*args, **kwargs)}
    run.__name__ = name
    return run


def rank_main(cases, *, world=2, seed=None, setup=None, group=True, backend="gloo",
              timeout_s=60, barrier_each=False, env=None, prepare=None):
    """The whole of a rank script's ``if __name__ == "__main__"``: reads ``RANK PORT OUT
    [ARGS]`` from sys.argv and runs this rank (tests/rank_exit.run_then_exit: the process
    leaves by os._exit once its results are written).

    The rank runs ``prepare(r)`` into ``r.state`` first (what must happen before the
    distributed environment exists: TRL's model saved to disk), then sets
    OMP_NUM_THREADS=1, the torch.distributed environment variables (for the frameworks
    that read them: accelerate, DeepSpeed) and ``env``; joins a ``backend`` process group
    of ``world`` ranks (None: run_ranks' n, from WORLD_SIZE) when ``group`` is set
    (``timeout_s``: None for torch's default);
    seeds torch's global generator (``seed``); runs ``setup(r)`` into ``r.state``; then
    each case: ``cases`` is a list of functions, or a function of r giving that list.
    Each case function returns a dict of results; an exception is recorded as
    "error: <type>: <message> <traceback>" under the function's name, so one failing case
    hides none of the others (the tests fail on it). ``barrier_each``: the ranks wait for
    each other after every case (a case that failed on one rank then does not run into the
    next case's collectives). The results go to OUT/rank<RANK>.json; the group is then
    destroyed after a barrier, with the frameworks' wrappers (reference cycles) freed
    first."""
    from rank_exit import run_then_exit

    world = int(os.environ["WORLD_SIZE"]) if world is None else world
    r = Rank(int(sys.argv[1]), world, sys.argv[3], sys.argv[4:])
    run_then_exit(_rank, r, int(sys.argv[2]), cases, seed, setup, group, backend, timeout_s,
                  barrier_each, env or {}, prepare)


def _rank(r, port, cases, seed, setup, group, backend, timeout_s, barrier_each, env, prepare):
    import torch
    import torch.distributed as dist

    if prepare is not None:
        r.state = prepare(r)
    os.environ.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(r.rank), LOCAL_RANK=str(r.rank), WORLD_SIZE=str(r.world),
                      LOCAL_WORLD_SIZE=str(r.world), **env)
    if group:
        kw = {} if timeout_s is None else dict(timeout=datetime.timedelta(seconds=timeout_s))
        dist.init_process_group(backend, rank=r.rank, world_size=r.world,
                                init_method=f"tcp://127.0.0.1:{port}", **kw)
    if seed is not None:
        torch.manual_seed(seed)
    if setup is not None:
        r.state = setup(r)
    res = {}
    for fn in cases(r) if callable(cases) else cases:
        try:
            res.update(fn(r))
        except Exception as e:  # recorded: the test fails on it
            res[fn.__name__] = f"error: {type(e).__name__}: {e} " + traceback.format_exc()
        if barrier_each:
            dist.barrier()
    with open(os.path.join(r.out, f"rank{r.rank}.json"), "w") as f:
        json.dump(res, f)
    if group:
        # the DDP wrappers (reference cycles) freed while the group still exists: a reducer
        # collected at interpreter exit, after the group is gone, aborted a rank
        # ("terminate called without an active exception") on a loaded machine
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
