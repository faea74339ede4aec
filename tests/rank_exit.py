"""The end of a rank script (tests/*_cases.py, launched by helpers/ranks.run_ranks;
helpers/ranks.rank_main ends here): run the rank's worker, then leave without the
interpreter's teardown. A process group, a DDP reducer or a DTensor mesh still referenced
at exit is destroyed after the group it belongs to, and gloo's threads then abort the
process ("terminate called without an active exception") after its results were written:
a failure of the launch, not of the case. An exception in the worker still exits non-zero
with its traceback."""

import os
import sys


def run_then_exit(worker, *args):
    worker(*args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
