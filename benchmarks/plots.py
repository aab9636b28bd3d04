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
    return _save(fig, path, title)


def ttft_bars(figures: dict[str, list[float]], path: str, title: str = "") -> str:
    """Bars of the median time to first token per phase (``{"cold": [s, ...], "restored": [...]}``),
    each prompt's figure as a dot over its bar. Returns ``path``."""
    import statistics

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if not figures or not all(figures.values()):
        raise ValueError("no TTFT figures to plot")
    names = list(figures)
    medians = [statistics.median(v) * 1e3 for v in figures.values()]
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(names), 4.2))
    bars = ax.bar(names, medians, color=[f"C{i}" for i in range(len(names))], alpha=0.8)
    for i, values in enumerate(figures.values()):
        ax.plot([i] * len(values), [v * 1e3 for v in values], "k.", alpha=0.6)
    for bar, m in zip(bars, medians, strict=True):
        ax.annotate(f"{m:.0f} ms", (bar.get_x() + bar.get_width() / 2, m), ha="center", va="bottom")
    ax.set_ylabel("time to first token (ms), median; dots: each prompt")
    ax.set_title(title or "TTFT")
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)


def latency_curve(rows: list[dict[str, Any]], path: str, title: str = "") -> str:
    """``bench_meta_load.py``: is_exist latency (p50, p99) and the load served, against the load offered
    (requests/s of the mix). Returns ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = sorted((r for r in rows if r.get("offered_rps")), key=lambda r: r["offered_rps"])
    if not rows:
        raise ValueError("no load levels to plot (the run produced none)")
    x = [r["offered_rps"] for r in rows]
    fig, (lat, served) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, style, label in (("probe_p50_us", "o-", "is_exist p50"), ("probe_p99_us", "o--", "is_exist p99"),
                              ("exist_p50_us", "s-", "batch_is_exist p50"),
                              ("exist_p99_us", "s--", "batch_is_exist p99")):
        lat.plot(x, [r[key] for r in rows], style, label=label)
    lat.set_yscale("log")
    lat.set_xlabel("offered load (requests/s of the mix)")
    lat.set_ylabel("latency (us)")
    lat.set_title("latency against offered load")
    lat.grid(True, which="both", alpha=0.3)
    lat.legend(fontsize=8)
    served.plot(x, [r["rps"] for r in rows], "o-", label="served requests/s")
    served.plot(x, x, ":", color="grey", label="offered")
    share = served.twinx()
    share.plot(x, [r["meta_cpu_share"] * 100 for r in rows], "s-", color="C3", label="MetaService CPU %")
    share.set_ylabel("MetaService CPU (% of one core)")
    served.set_xlabel("offered load (requests/s of the mix)")
    served.set_ylabel("requests/s")
    served.set_title("load served")
    served.grid(True, alpha=0.3)
    served.legend(loc="upper left", fontsize=8)
    share.legend(loc="lower right", fontsize=8)
    return _save(fig, path, title)


def _save(fig: Any, path: str, title: str = "") -> str:
    """Give ``fig`` its title, write it to ``path`` and free it. Returns ``path``."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
