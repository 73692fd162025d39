"""Figures from compare.layer records (matplotlib, Agg backend; no measuring here).

``layer_chart``: one panel per (shape, routing, ep, tokens per rank); one bar per implementation /
precision, split into forward (lower) and backward (upper) ms, the fwd+bwd compute floor of that
precision as a black tick, the fwd+bwd speedup against the first stock variant written on top.
Records that did not run are listed under the panel with their status.
"""

from __future__ import annotations

from pathlib import Path

from compare.records import impl_label

__all__ = ["layer_chart"]


def _group_key(rec: dict) -> tuple:
    s = rec["shape"]
    return (s["name"], rec["routing"], rec["ep"], rec["tokens_per_rank"])


def layer_chart(records: list[dict], path: str | Path, title: str = "") -> Path:
    """Write the chart of ``records`` to ``path`` (PNG) and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault(_group_key(r), []).append(r)
    n = max(1, len(groups))
    cols = min(2, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 4.6 * rows + 0.5), squeeze=False)
    for ax, (key, recs) in zip(axes.flat, groups.items()):
        ok = [r for r in recs if r["status"] == "ok"]
        labels = [f"{impl_label(r)}\n{r['precision']}" for r in ok]
        xs = list(range(len(ok)))
        fwd = [r["fwd_ms"] for r in ok]
        bwd = [r["bwd_ms"] for r in ok]
        colors = ["#4C72B0" if r["family"] == "stock" else "#DD8452" for r in ok]
        ax.bar(xs, fwd, color=colors, edgecolor="black", linewidth=0.5)
        ax.bar(xs, bwd, bottom=fwd, color=colors, alpha=0.55, edgecolor="black", linewidth=0.5,
               hatch="//")
        for x, r in zip(xs, ok):
            if r.get("floor_ms"):
                ax.plot([x - 0.4, x + 0.4], [r["floor_ms"]] * 2, color="black", linewidth=1.5)
            sp = [v["fwdbwd"] for k, v in r["speedup_vs"].items() if v.get("fwdbwd")]
            txt = f"{r['fwdbwd_ms']:.2f} ms"
            first_stock = next(iter(r["speedup_vs"]), None)
            if sp and first_stock and r["family"] != "stock":
                txt += f"\n{r['speedup_vs'][first_stock]['fwdbwd']:.2f}x vs {first_stock}"
            ax.text(x, r["fwdbwd_ms"], txt, ha="center", va="bottom", fontsize=7)
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel("ms (median, max over ranks)")
        name, routing, ep, tokens = key
        ax.set_title(f"{name} | routing {routing} | EP={ep} | {tokens} tokens/rank", fontsize=9)
        if ok:
            top = max(max(r["fwdbwd_ms"], r.get("floor_ms") or 0.0) for r in ok)
            ax.set_ylim(0, top * 1.3)
        not_run = [f"{r['implementation']}/{r['precision']}: {r['status']}" for r in recs
                   if r["status"] != "ok"]
        if not_run:
            ax.set_xlabel("not run: " + "; ".join(not_run[:6]) + (" ..." if len(not_run) > 6 else ""),
                          fontsize=6, wrap=True)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(facecolor="#4C72B0", edgecolor="black", label="stock TorchTitan"),
               Patch(facecolor="#DD8452", edgecolor="black", label="megamoe"),
               Patch(facecolor="white", edgecolor="black", label="forward (lower part)"),
               Patch(facecolor="white", edgecolor="black", hatch="//", label="backward (upper part)"),
               Line2D([], [], color="black", linewidth=1.5, label="fwd+bwd compute floor")]
    fig.legend(handles=handles, loc="upper center", ncol=5, fontsize=7, frameon=False,
               bbox_to_anchor=(0.5, 0.965))
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
