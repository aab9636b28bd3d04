"""Pictures of benchmark results (matplotlib, the ``bench`` extra): GB/s against batch size."""

from __future__ import annotations

from typing import Any


def bandwidth(rows: list[dict[str, Any]], path: str, title: str = "") -> str:
    """One panel per (protocol, layout): GB/s of each op against batch size, memcpy of the same bytes
    dashed beside each op. Returns ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in rows if "gbps" in r and r.get("auth", True)]
    if not rows:
        raise ValueError("no bandwidth figures to plot (the run produced none)")
    panels = sorted({(r["protocol"], r["layout"]) for r in rows})
    ncols = min(2, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 4.5 * nrows), squeeze=False, sharey=True)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (protocol, layout) in zip(axes.flat, panels, strict=False):
        mine = [r for r in rows if (r["protocol"], r["layout"]) == (protocol, layout)]
        for i, op in enumerate(sorted({r["op"] for r in mine})):
            pts = sorted((r["batch"], r["gbps"], r["memcpy_gbps"]) for r in mine if r["op"] == op)
            colour = f"C{i}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colour, label=op)
            ax.plot([p[0] for p in pts], [p[2] for p in pts], ":", color=colour, alpha=0.6,
                    label=f"memcpy beside {op}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (objects)")
        ax.set_title(f"{mine[0]['engine']} {protocol}, {layout}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for row in axes:
        row[0].set_ylabel("GB/s")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
