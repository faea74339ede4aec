"""The report's PNG plots (matplotlib, Agg) from its CSV rows (report.py documents them):

  <prefix>_time.png    median time [ms] against N (at the base V), one panel per op
  <prefix>_memory.png  peak extra memory [MiB] against N (at the base V), one panel per op
  <prefix>_vocab.png   time and memory against V (at the base N): ppo_loss, from hidden
Log-log axes; colour = the row (the fused backend or a baseline), solid = float32, dashed =
bfloat16; the grey line is the op's floor (time; dashed for bfloat16), the grey dotted one a
single [N, V] float32 buffer (memory); a row whose peaks are all 0 is named in the panel
instead of drawn.
"""

from __future__ import annotations

import os

COLOURS = {"eager composite": "C1", "torch.compile": "C2", "plain composite": "C5",
           "F.cross_entropy": "C6", "triton": "C4", "floor": "0.45"}
STYLE = {"float32": dict(ls="-", marker="o"), "bfloat16": dict(ls="--", marker="s")}
TITLES = {"token_logprobs": "token_logprobs (forward)", "ppo_loss": "ppo_loss (fwd+bwd)",
          "ppo_loss_gspo": "ppo_loss, gspo (fwd+bwd)", "score_rollout": "score_rollout",
          "gae": "gae ([B, T], float32)", "ppo_loss_from_hidden": "ppo_loss_from_hidden (fwd+bwd)"}


def colour(backend, fused):
    if backend == fused:
        return "C0"
    if backend.endswith("materialised"):
        return "C3"
    return COLOURS.get(backend, "C7")


def _lines(ax, rows, xkey, ykey, fused):
    """One line per (backend, dtype) of rows (the floor apart: _floor), x sorted."""
    keys = sorted({(r["backend"], r["dtype"]) for r in rows if r["backend"] != "floor"})
    for backend, dtype in keys:
        pts = sorted((r[xkey], r[ykey]) for r in rows
                     if (r["backend"], r["dtype"]) == (backend, dtype) and r[ykey] > 0)
        if pts:
            ax.plot(*zip(*pts), color=colour(backend, fused), ms=4, lw=1.4, **STYLE[dtype])


def _zeros_note(ax, rows):
    """Names the backends whose every peak is 0 (a log axis cannot draw them)."""
    rows = [r for r in rows if r["backend"] != "floor"]
    zero = sorted({r["backend"] for r in rows} - {r["backend"] for r in rows
                                                   if r["peak_extra_mib"] > 0.01})
    if zero:
        ax.text(0.98, 0.03, "~0 MiB: " + ", ".join(zero), transform=ax.transAxes,
                ha="right", va="bottom", fontsize=8, color="0.3")


def _floor(ax, rows, xkey, ykey, dtypes):
    """The floor rows among rows, one grey line per dtype."""
    for d in dtypes:
        pts = sorted((r[xkey], r[ykey]) for r in rows
                     if r["backend"] == "floor" and r["dtype"] == d and r[ykey] > 0)
        if pts:
            ax.plot(*zip(*pts), color="0.45", lw=1.0, ls="--" if d == "bfloat16" else "-",
                    alpha=0.8)


def _buffer_line(ax, xs, mib_of_x):
    xs = sorted(set(xs))
    if xs:
        ax.plot(xs, [mib_of_x(x) for x in xs], color="0.45", ls=":", lw=1.2)


def _axes(ax, title, xlabel, ylabel):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.grid(True, which="both", alpha=0.25)
    ax.tick_params(labelsize=8)


def _handles(rows, fused, floor=True, buffer=True):
    from matplotlib.lines import Line2D

    backends = sorted({r["backend"] for r in rows if r["backend"] != "floor"},
                      key=lambda b: (b != fused, b))
    hs = [Line2D([], [], color=colour(b, fused), lw=2, label=b) for b in backends]
    hs += [Line2D([], [], color="0.45", ls="--", label="floor")] if floor else []
    hs += [Line2D([], [], color="0.45", ls=":", label="one [N, V] fp32 buffer")] if buffer else []
    hs += [Line2D([], [], color="k", label=d, **STYLE[d]) for d in STYLE
           if any(r["dtype"] == d for r in rows)]
    return hs


def _save(fig, path, handles, legend_ax=None):
    """The legend in legend_ax (a spare panel), else in a strip below the panels."""
    if legend_ax is not None:
        legend_ax.legend(handles=handles, loc="center", fontsize=9, frameon=False)
        legend_ax.axis("off")
        fig.tight_layout(rect=(0, 0, 1, 0.96))
    else:
        fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=9,
                   frameon=False)
        fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    fig.savefig(path, dpi=110)
    return path


def plot_all(rows, a, prefix, fused):
    """Writes the three figures into a.out; returns their paths ([] without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no plots (the CSV is written)")
        return []
    if not rows:
        return []
    bn, bv = a.base
    dtypes = sorted({r["dtype"] for r in rows})
    on_n = [r for r in rows if r["V"] in (bv, "")]  # the N sweep (gae has no V)
    on_v = [r for r in rows if r["N"] == bn and r["V"] != ""]
    where = f"({a.device})"
    paths = []

    fig, axs = plt.subplots(2, 3, figsize=(13, 7.5))
    for ax, op in zip(axs.flat, ["token_logprobs", "ppo_loss", "ppo_loss_gspo",
                                 "score_rollout", "ppo_loss_from_hidden", "gae"]):
        mine = [r for r in on_n if r["op"] == op]
        _lines(ax, mine, "N", "median_ms", fused)
        _floor(ax, mine, "N", "median_ms", dtypes)
        sub = "" if op == "gae" else f", V={bv}" + (f", H={a.h}" if "hidden" in op else "")
        _axes(ax, TITLES[op] + sub, "N (tokens)", "median time [ms]")
    fig.suptitle(f"time against N {where}, lower is better", fontsize=11)
    paths.append(_save(fig, os.path.join(a.out, f"{prefix}_time.png"),
                       _handles(rows, fused, buffer=False)))
    plt.close(fig)

    fig, axs = plt.subplots(2, 3, figsize=(13, 7.5))
    mem_ops = ["token_logprobs", "ppo_loss", "ppo_loss_gspo", "score_rollout",
               "ppo_loss_from_hidden"]
    for ax, op in zip(axs.flat, mem_ops):
        mine = [r for r in on_n if r["op"] == op]
        _lines(ax, mine, "N", "peak_extra_mib", fused)
        _zeros_note(ax, mine)
        _buffer_line(ax, [r["N"] for r in mine], lambda n: n * bv * 4 / 2**20)
        sub = f", V={bv}" + (f", H={a.h}" if "hidden" in op else "")
        _axes(ax, TITLES[op] + sub, "N (tokens)", "peak extra memory [MiB]")
    fig.suptitle(f"peak extra memory of one call against N {where}, lower is better",
                 fontsize=11)
    paths.append(_save(fig, os.path.join(a.out, f"{prefix}_memory.png"),
                       _handles(rows, fused, floor=False), axs.flat[-1]))
    plt.close(fig)

    fig, axs = plt.subplots(2, 2, figsize=(10, 7.5))
    for j, op in enumerate(["ppo_loss", "ppo_loss_from_hidden"]):
        mine = [r for r in on_v if r["op"] == op]
        sub = f", N={bn}" + (f", H={a.h}" if "hidden" in op else "")
        _lines(axs[0, j], mine, "V", "median_ms", fused)
        _floor(axs[0, j], mine, "V", "median_ms", dtypes)
        _axes(axs[0, j], TITLES[op] + sub, "V (vocabulary)", "median time [ms]")
        _lines(axs[1, j], mine, "V", "peak_extra_mib", fused)
        _zeros_note(axs[1, j], mine)
        _buffer_line(axs[1, j], [r["V"] for r in mine], lambda v: bn * v * 4 / 2**20)
        _axes(axs[1, j], TITLES[op] + sub, "V (vocabulary)", "peak extra memory [MiB]")
    fig.suptitle(f"time and memory against V {where}, lower is better", fontsize=11)
    paths.append(_save(fig, os.path.join(a.out, f"{prefix}_vocab.png"), _handles(rows, fused)))
    plt.close(fig)
    return paths
