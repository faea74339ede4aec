#!/usr/bin/env python
"""Mutation testing of the formula modules, on demand (not in CI): docs/TESTING.md,
"Mutation testing".

Each mutant is one textual change of one source line (an operator swap such as <= -> <,
>= -> >, + -> -, a constant tweak, a dropped term, ``where(c, x, 0)`` -> ``x``). The
script copies the repository once into a temporary directory (the tracked and untracked
files that git does not ignore, plus the built extension ppo_kernels/_C*.so), and for
each mutant writes the mutated file into the copy, runs the fast tier of the test suite
against it with a timeout, and restores the file. A mutant is

  caught     the tier fails (or times out: a mutant that hangs is a detected one),
  survived   the tier passes: either a gap in the tests, or an equivalent mutant; the
             known-equivalent ones are listed in EQUIVALENT with the reason.

Python mutants need no rebuild: the copy is imported through PYTHONPATH (the script
checks that ``import ppo_kernels`` resolves inside the copy). Triton mutants
(triton_kernels/_math.py) run under the Triton interpreter with the
"triton" tier. C++ mutants (csrc/) need the extension rebuilt in the copy: --build runs
``python setup.py build_ext --inplace`` there before the tier (minutes per mutant, and
it takes every core: never on a shared machine while others work).

Usage:
  python scripts/mutate.py --list                 # the curated mutants
  python scripts/mutate.py M31 M14                # some of them
  python scripts/mutate.py --all                  # every curated Python mutant
  python scripts/mutate.py --auto ppo_kernels/rollout_correction.py --limit 20
                                                  # generated operator swaps of a file
  python scripts/mutate.py --tier triton T1       # a Triton _math.py mutant
Exit status: 0 when every non-equivalent mutant was caught, 1 otherwise.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The fast tier: core files, `-x -q -k "not triton"`; the module's own test file runs
# first (Mutant.first) so that a caught mutant stops early.
FAST_TIER = ["tests/test_rollout_correction.py", "tests/test_reference.py",
             "tests/test_loss_menu.py", "tests/test_loss.py", "tests/test_properties.py",
             "tests/test_advantages.py", "tests/test_sampling.py", "tests/test_spec.py"]
TIERS = {
    "fast": (FAST_TIER, "not triton"),
    # the Triton interpreter: slow; for mutants of triton_kernels/
    "triton": (["tests/test_triton_kernels.py", "tests/test_loss.py",
                "tests/test_rollout_correction.py"], "triton"),
    # the compiled backends' row math (csrc/): after --build
    "cpp": (["tests/test_loss.py", "tests/test_loss_menu.py", "tests/test_csrc.py",
             "tests/test_rollout_correction.py"], "not triton"),
}


@dataclass(frozen=True)
class Mutant:
    id: str
    path: str     # relative to the repository root
    find: str     # an exact substring, unique in the file
    replace: str
    what: str
    first: tuple = ()  # test files to run first (then the rest of the tier)
    tier: str = "fast"


RC, REF, TI = "ppo_kernels/rollout_correction.py", "ppo_kernels/reference.py", \
    "ppo_kernels/_torch_impl.py"
LOSS, ADV, SAMP = "ppo_kernels/loss.py", "ppo_kernels/advantages.py", "ppo_kernels/sampling.py"
TRC, TREF = "tests/test_rollout_correction.py", "tests/test_reference.py"
TM = "triton_kernels/_math.py"

# The curated mutants (the ids M* follow the 2026-12 test audit's table).
MUTANTS = [
    Mutant("M1", REF, "unclipped_active = unclipped >= clipped",
           "unclipped_active = unclipped > clipped", "PPO clip: >= -> >", (TREF,)),
    Mutant("M5", RC, "inside = (r >= lo) & (r <= hi)", "inside = (r > lo) & (r < hi)",
           "rollout bounds inclusive -> exclusive", (TRC,)),
    Mutant("M6", RC, "(raw < 0.9) | (raw > 1.1)", "(raw < 0.9) | (raw > 1.2)",
           "outside_frac band 1.1 -> 1.2", (TRC,)),
    Mutant("M7", RC, "- mask.any().float()", "- 1.0", "rollout_chi2: - any -> - 1", (TRC,)),
    Mutant("M8", TI, "return ((a_seq >= 0) | (kl <= threshold))",
           "return ((a_seq > 0) | (kl <= threshold))", "off-policy keep A >= 0 -> A > 0",
           (TRC,)),
    Mutant("M9", ADV, None, None, "whiten variance /(n - 1) -> /n"),  # resolved below
    Mutant("M11", RC, "    if mode in (\"tis\", \"tis-seq\"):\n        w = torch.clamp(r, lo, hi)",
           "    if mode == \"tis\":\n        w = torch.clamp(r, lo, hi)\n    elif mode == "
           "\"tis-seq\":\n        w = r", "tis-seq truncation dropped", (TRC,)),
    Mutant("M12", RC, "w = torch.clamp(r, lo, hi)", "w = torch.clamp(r, max=hi)",
           "tis lower bound dropped (product)", (TRC,)),
    Mutant("M14", LOSS, "(dropped & nonempty).sum() / nonempty.sum().clamp(min=1)",
           "(dropped & nonempty).sum() / max(nonempty.numel(), 1)",
           "off_policy_masked_frac / B instead of / non-empty", (TRC,)),
    Mutant("M15", TI, "(~up & (pn < po) & (div > eps_low))",
           "(~up & (pn < po) & (div > eps_high))", "DPPO A <= 0 side uses eps_high (product)",
           ("tests/test_loss_menu.py",)),
    Mutant("M28", REF, "w = np.clip(r, lo, hi)", "w = np.minimum(r, hi)",
           "tis lower bound dropped (reference)", (TRC,)),
    Mutant("M29", REF, "(pn < po) & (div > eps_low))", "(pn < po) & (div > eps_high))",
           "DPPO A <= 0 side uses eps_high (reference)", ("tests/test_loss_menu.py",)),
    Mutant("M31", RC, "        w = torch.where(inside, r, 0.0)",
           "        w = torch.where(inside | (mode == \"mis-seq\"), r, 0.0)",
           "mis-seq never masks", (TRC,)),
    Mutant("M32", RC, "return 1.0 / hi, hi", "return 0.0, hi", "geo-seq bounds (1/C, C) -> (0, C)",
           (TRC,)),
    Mutant("M38", TI, "behaviour_logprobs - logp.detach()", "logp.detach() - behaviour_logprobs",
           "off-policy KL sign flipped", (TRC,)),
    Mutant("M45", SAMP, "above = excl.gather(-1, first)", "above = excl",
           "top-p mass above not grouped by ties", ("tests/test_sampling.py",)),
    Mutant("M47", RC, "r = torch.exp(seq_mean(l_tok, mask, group)).expand_as(l_tok)",
           "r = torch.exp(seq_sum(l_tok, group)).expand_as(l_tok)",
           "geo-seq: geometric mean -> product", (TRC,)),
    Mutant("M48", RC, "return torch.where(mask, w, 0.0)\n", "return w\n",
           "rollout weights: where(mask, w, 0) -> w", (TRC,)),
    # Triton row math (interpreter; tier "triton"): see docs/TESTING.md
    Mutant("T1", TM, "unclipped_active = unclipped >= clipped",
           "unclipped_active = unclipped > clipped", "triton PPO clip: >= -> >",
           ("tests/test_triton_kernels.py",), "triton"),
    Mutant("T2", TM, "(pn < po) & (div > eps_low))", "(pn < po) & (div > eps_high))",
           "triton DPPO A <= 0 side uses eps_high", ("tests/test_triton_kernels.py",),
           "triton"),
    Mutant("T3", TM, "dual = (adv < 0.0) & (pg > cap)", "dual = (adv < 0.0) & (pg < cap)",
           "triton dual clip direction flipped", ("tests/test_triton_kernels.py",), "triton"),
    # C++ row math shared by the cpu and cuda kernels (tier "cpp", needs --build)
    Mutant("C1", "csrc/ppo_math.h", None, None, "ppo_math.h: the PPO clip's >= -> >",
           (), "cpp"),
]

# Mutants that survive by construction, and why (docs/TESTING.md lists them too).
EQUIVALENT = {
    "M45": "top_p's threshold is the smallest kept value, and keep is then re-derived as "
           "x >= threshold downstream, so the tied entries that the ungrouped 'mass above' "
           "drops come back: the kept sets are the same.",
}


def _resolve(m: Mutant, text: str) -> Mutant:
    """The mutants whose find string is derived from the file (None)."""
    if m.find is not None:
        return m
    if m.id == "M9":
        hit = re.search(r"/ *\(n *- *1(\.0)?\)", text) or re.search(r"n *- *1", text)
        if hit is None:
            raise SystemExit(f"{m.id}: no (n - 1) in {m.path}")
        return Mutant(m.id, m.path, hit.group(0), hit.group(0).replace("- 1", "- 0"),
                      m.what, ("tests/test_advantages.py",))
    if m.id == "C1":  # the clip's tie rule, however ppo_math.h spells it
        hit = re.search(r"unclipped\w* *>= *clipped\w*", text)
        if hit is None:
            raise SystemExit(f"{m.id}: no 'unclipped >= clipped' in {m.path}")
        return Mutant(m.id, m.path, hit.group(0), hit.group(0).replace(">=", ">"), m.what,
                      m.first, m.tier)
    raise SystemExit(f"{m.id}: no find string")


# ------------------------------------------------------------------ generated mutants

_SWAPS = [(" <= ", " < "), (" >= ", " > "), (" < ", " <= "), (" > ", " >= "),
          (" + ", " - "), (" - ", " + "), (" * 2.0", " * 3.0"), ("1.0 - ", "1.0 + ")]
_WHERE_ZERO = re.compile(r"torch\.where\(([^,()]+), ([^,()]+), 0\.0\)")


def auto_mutants(path, limit=None):
    """Single-point operator swaps and where(c, x, 0) -> x of each code line of path
    (comments, docstrings and raise / f-string lines left alone)."""
    text = open(os.path.join(ROOT, path)).read()
    out, in_doc = [], False
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines, 1):
        s = line.strip()
        if s.count('"""') == 1:
            in_doc = not in_doc
            continue
        if in_doc or not s or s.startswith(("#", "raise", "f\"", "\"", "def ", "assert")):
            continue
        code = line.split("#")[0]
        cands = [(a, b) for a, b in _SWAPS if a in code]
        cands += [(mm.group(0), mm.group(2)) for mm in _WHERE_ZERO.finditer(code)]
        for a, b in cands:
            k = code.index(a)
            new = line[:k] + b + line[k + len(a):]
            # unique anchor: the whole line with its neighbours
            before = "".join(lines[max(0, i - 2):i - 1])
            find = before + line
            if text.count(find) != 1:
                continue
            out.append(Mutant(f"{os.path.basename(path)}:{i}:{a.strip()}->{b.strip()}", path,
                              find, before + new, f"line {i}: {a.strip()!r} -> {b.strip()!r}"))
    return out[:limit] if limit else out


# ------------------------------------------------------------------ running

def make_copy():
    """A temporary copy of the working tree (git's tracked + untracked-not-ignored files)
    with the built extension."""
    dst = tempfile.mkdtemp(prefix="ppo-mutate-")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = os.path.join(ROOT, f)
        if not os.path.isfile(src):
            continue
        os.makedirs(os.path.dirname(os.path.join(dst, f)) or dst, exist_ok=True)
        shutil.copy2(src, os.path.join(dst, f))
    # the built extension modules (_C*.so, _cpu_*.so, ...): ignored by git
    for so in glob.glob(os.path.join(ROOT, "ppo_kernels", "**", "*.so"), recursive=True):
        rel = os.path.relpath(so, ROOT)
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        shutil.copy2(so, os.path.join(dst, rel))
    return dst


def env_for(copy):
    env = dict(os.environ, PYTHONPATH=copy + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONDONTWRITEBYTECODE="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def check_import(copy, python):
    # the copy's package, with its compiled cpu backend working (a missing .so would make
    # every mutant look caught)
    got = subprocess.run([python, "-c", "import ppo_kernels as pk, os, torch; pk.token_logprobs("
                          "torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long), "
                          "backend='cpu'); print(os.path.realpath(pk.__file__))"], cwd=copy,
                         env=env_for(copy), capture_output=True, text=True)
    where = got.stdout.strip()
    if got.returncode or not where.startswith(os.path.realpath(copy)):
        raise SystemExit(f"the copy's ppo_kernels does not import from the copy: {where!r} "
                         f"{got.stderr[-2000:]}")


def run_one(m, copy, python, timeout, build):
    path = os.path.join(copy, m.path)
    orig = open(path).read()
    m = _resolve(m, orig)
    if orig.count(m.find) != 1:
        return m, "not-applied", f"find string occurs {orig.count(m.find)} times", 0.0
    line = orig[:orig.index(m.find)].count("\n") + 1
    t0 = time.time()
    try:
        with open(path, "w") as f:
            f.write(orig.replace(m.find, m.replace, 1))
        if build:
            b = subprocess.run([python, "setup.py", "build_ext", "--inplace"], cwd=copy,
                               env=env_for(copy), capture_output=True, text=True)
            if b.returncode:
                return m, "caught", f"{m.path}:{line} (does not build)", time.time() - t0
        files, k = TIERS[m.tier]
        order = list(m.first) + [f for f in files if f not in m.first]
        cmd = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-k", k, *order]
        try:
            r = subprocess.run(cmd, cwd=copy, env=env_for(copy), capture_output=True,
                               text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return m, "caught", f"{m.path}:{line} (timeout {timeout}s)", time.time() - t0
        if r.returncode == 0:
            return m, "survived", f"{m.path}:{line}", time.time() - t0
        if r.returncode in (2, 3, 4):  # interrupted / internal error / usage: not a verdict
            return m, "error", f"{m.path}:{line} pytest rc {r.returncode}: " \
                               f"{r.stdout[-800:]}{r.stderr[-800:]}", time.time() - t0
        failed = [ln for ln in r.stdout.splitlines() if ln.startswith("FAILED")]
        return m, "caught", f"{m.path}:{line} by {failed[0][7:] if failed else '?'}", \
            time.time() - t0
    finally:
        with open(path, "w") as f:
            f.write(orig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ids", nargs="*", help="curated mutant ids (default with --all: all)")
    ap.add_argument("--all", action="store_true", help="every curated mutant of its tier")
    ap.add_argument("--auto", action="append", default=[], metavar="PATH",
                    help="generated operator swaps of a module (repeatable)")
    ap.add_argument("--limit", type=int, default=None, help="at most this many per --auto")
    ap.add_argument("--tier", choices=sorted(TIERS), default=None,
                    help="only mutants of this tier (default: fast, or each id's own)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant")
    ap.add_argument("--build", action="store_true",
                    help="rebuild the extension in the copy (csrc/ mutants)")
    ap.add_argument("--no-baseline", dest="baseline", action="store_false",
                    help="skip the unmutated run of the tier (when it is known to pass)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    a = ap.parse_args(argv)
    by_id = {m.id: m for m in MUTANTS}
    if a.list:
        for m in MUTANTS:
            eq = "  [equivalent]" if m.id in EQUIVALENT else ""
            print(f"{m.id:5s} {m.tier:6s} {m.path}: {m.what}{eq}")
        return 0
    chosen = [by_id[i] for i in a.ids]
    if a.all:
        chosen += [m for m in MUTANTS if m.tier == (a.tier or "fast") and m not in chosen]
    for p in a.auto:
        chosen += auto_mutants(p, a.limit)
    if not chosen:
        ap.error("no mutants: give ids, --all or --auto")
    copy = make_copy()
    try:
        check_import(copy, a.python)
        if a.baseline:  # the unmutated copy passes the tiers used (else every verdict lies)
            for tier in sorted({m.tier for m in chosen}):
                files, k = TIERS[tier]
                r = subprocess.run([a.python, "-m", "pytest", "-x", "-q", "-p",
                                    "no:cacheprovider", "-k", k, *files], cwd=copy,
                                   env=env_for(copy), capture_output=True, text=True)
                if r.returncode:
                    raise SystemExit(f"the unmutated copy fails tier {tier}:\n"
                                     f"{r.stdout[-3000:]}")
                print(f"baseline: tier {tier} passes unmutated", flush=True)
        tally = {"caught": [], "survived": [], "equivalent": [], "not-applied": [],
                 "error": []}
        for m in chosen:
            m, verdict, where, secs = run_one(m, copy, a.python, a.timeout, a.build)
            if verdict == "survived" and m.id in EQUIVALENT:
                verdict = "equivalent"
            tally[verdict].append((m, where))
            print(f"{m.id:24s} {verdict:11s} {secs:6.0f}s  {m.what}: {where}", flush=True)
        print(f"\nmutants tried {len(chosen)}: caught {len(tally['caught'])}, surviving "
              f"{len(tally['survived'])}, equivalent {len(tally['equivalent'])}, not applied "
              f"{len(tally['not-applied'])}, errors {len(tally['error'])}")
        for m, where in tally["survived"]:
            print(f"  SURVIVED {m.id}: {m.what} at {where}")
        for m, where in tally["equivalent"]:
            print(f"  equivalent {m.id} at {where}: {EQUIVALENT[m.id]}")
        return 1 if tally["survived"] or tally["error"] or tally["not-applied"] else 0
    finally:
        shutil.rmtree(copy, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
