"""Plots for benchmark reports (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

from kvserve.platform.extras import pyplot


def plot_decode_scaling(scaling: dict[str, dict[int, float]], path: Path, title: str) -> None:
    """Decode tokens/s against batch size, one line per engine."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 4))
    for engine, values in scaling.items():
        sizes = sorted(values)
        ax.plot(sizes, [values[b] for b in sizes], marker="o", label=engine)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (concurrent sequences)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Decode throughput vs batch size\n{title}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_serving_latency(runs_by_server: dict[str, list[dict]], path: Path, title: str) -> None:
    """TTFT (p50, p99) and TPOT (p50, p99) against request rate, one colour per server.

    ``runs_by_server`` maps a server label to ``kvserve bench serve`` runs (``request_rate`` and
    ``summary``). An infinite rate is drawn one step to the right of the largest finite one.
    """
    import math

    plt = pyplot()

    finite = [r["request_rate"] for runs in runs_by_server.values() for r in runs if not _is_inf(r["request_rate"])]
    inf_x = max(finite) * 2 if finite else 1.0
    fig, (ax_ttft, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (server, runs) in enumerate(runs_by_server.items()):
        runs = sorted(runs, key=lambda r: math.inf if _is_inf(r["request_rate"]) else float(r["request_rate"]))
        xs = [inf_x if _is_inf(r["request_rate"]) else float(r["request_rate"]) for r in runs]
        colour = f"C{i}"
        for ax, metric in ((ax_ttft, "ttft_ms"), (ax_tpot, "tpot_ms")):
            for pct, style in (("p50", "-"), ("p99", "--")):
                ys = [r["summary"][metric][pct] for r in runs]
                ys = [math.nan if y is None else y for y in ys]
                ax.plot(xs, ys, style, marker="o", color=colour, label=f"{server} {pct}")
    ticks = sorted(set(finite)) + ([inf_x] if any(_has_inf(runs) for runs in runs_by_server.values()) else [])
    for ax, name in ((ax_ttft, "time to first token (ms)"), (ax_tpot, "time per output token (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [("inf" if t == inf_x and t not in finite else f"{t:g}") for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Serving latency vs request rate\n{title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _is_inf(rate: float | str) -> bool:
    return rate == "inf" or (isinstance(rate, float) and rate == float("inf"))


def _has_inf(runs: list[dict]) -> bool:
    return any(_is_inf(r["request_rate"]) for r in runs)


def plot_speed_ratios(report: dict, path: Path) -> None:
    """kvserve's speed-up over each peer per measurement (higher is better; 1 = parity)."""
    plt = pyplot()

    ours, peers = report["results"][0], report["results"][1:]
    if not peers:
        return
    contexts = list(ours.get("long_decode_tokens_per_s", {}))
    labels = [f"prefill {n}" for n in ours["prefill_s"]] + ["decode b=1"] + [f"decode @{n}" for n in contexts]
    labels += [f"{b} seqs" for b in ours["batch_tokens_per_s"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(peers)
    for i, peer in enumerate(peers):
        ratios = [peer["prefill_s"][n] / ours["prefill_s"][n] for n in ours["prefill_s"]]
        ratios.append(ours["decode_tokens_per_s"] / peer["decode_tokens_per_s"])
        ratios += [ours["long_decode_tokens_per_s"][n] / peer["long_decode_tokens_per_s"][n] for n in contexts]
        ratios += [ours["batch_tokens_per_s"][b] / peer["batch_tokens_per_s"][b] for b in ours["batch_tokens_per_s"]]
        xs = [x + (i - (len(peers) - 1) / 2) * width for x in range(len(labels))]
        bars = ax.bar(xs, ratios, width, label=f"vs {peer['engine']}")
        ax.bar_label(bars, fmt="%.1fx", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_yscale("log")
    ax.set_ylabel(f"{ours['engine']} speed-up (x)")
    ax.set_title(f"{ours['engine']} vs peers: {report['model']}, {report['threads']} threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_prefill_parallel(report: dict, path: Path) -> None:
    """TTFT against context length per method (with the paper's bound), and the searched first chunk's share."""
    plt = pyplot()

    r = report["results"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for method, by_length in r["ttft_s"].items():
        lengths = sorted(by_length, key=int)
        left.plot([int(n) for n in lengths], [by_length[n] for n in lengths], marker="o", label=method)
    if r["bound_s"]:
        lengths = sorted(r["bound_s"], key=int)
        left.plot([int(n) for n in lengths], [r["bound_s"][n] for n in lengths], "k--", label="bound TTFT*(p)")
    left.set_xlabel("prompt tokens")
    left.set_ylabel("time to first token (s)")
    left.set_title(f"TTFT, p = {report['prefill_parallel']}: {report['model']}")
    left.grid(True, alpha=0.3)
    left.legend()
    for method in ("KVR-S", "KVR-P", "KVR-E"):
        by_length = r["partitions"].get(method)
        if by_length:
            lengths = sorted(by_length, key=int)
            shares = [by_length[n][0] / sum(by_length[n]) for n in lengths]
            right.plot([int(n) for n in lengths], shares, marker="o", label=method)
    right.set_xlabel("prompt tokens")
    right.set_ylabel("first process's share of the prompt")
    right.set_title("Partitions (the rest goes to later processes)")
    right.grid(True, alpha=0.3)
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_compression(report: dict, path: Path) -> None:
    """KV per sequence, peak batch and throughput per policy, at one KV memory."""
    plt = pyplot()

    results = report["results"]
    names = [f"{r['policy']}" + ("" if r["policy"] == "full" else f" {r['budget']:g}") for r in results]
    panels = [
        ("KV per sequence after prefill (MB)", [r["kv_bytes_per_seq"] / 1e6 for r in results]),
        ("peak sequences running at once", [r["peak_running"] for r in results]),
        (
            "seconds in steps with prompt tokens",
            [r.get("seconds", 0.0) - r.get("decode_seconds", 0.0) for r in results],
        ),
        ("output tokens/s (end to end)", [r["output_tokens_per_s"] for r in results]),
        ("decode tokens/s (decode-only steps)", [r["decode_tokens_per_s"] for r in results]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    for ax, (title, values) in zip(axes, panels, strict=True):
        ax.bar(names, values, color=["#888888"] + ["#3b7dd8"] * (len(values) - 1))
        ax.set_title(title, fontsize=10)
        for i, v in enumerate(values):
            ax.annotate(f"{v:.3g}", (i, v), ha="center", va="bottom", fontsize=8)
    fig.suptitle(f"{report['model']}, {report['dtype']}, KV memory {report['kv_cache_memory']}: {report['workload']}",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_prompt_cache(report: dict, path: Path) -> None:
    """Median TTFT per document length, one bar per method (log scale), with the speed-up over no cache."""
    plt = pyplot()

    lengths = report["lengths"]
    methods = list(dict.fromkeys(r["method"] for r in report["results"]))
    ttft = {(r["target_tokens"], r["method"]): r["median_ttft_s"] * 1e3 for r in report["results"]}
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, method in enumerate(methods):
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(lengths))]
        values = [ttft[(n, method)] for n in lengths]
        ax.bar(xs, values, width, label=method)
        for x, n, v in zip(xs, lengths, values, strict=True):
            ax.annotate(f"{ttft[(n, 'no cache')] / v:.0f}x", (x, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths])
    ax.set_yscale("log")
    ax.set_xlabel("document tokens (the module)")
    ax.set_ylabel("median time to first token (ms)")
    layout = report.get("layout", "prefix")
    ax.set_title(f"Prompt Cache TTFT ({layout}), {report['model']}, {report['dtype']}, {report['threads']} threads",
                 fontsize=10)  # fmt: skip
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_offload(report: dict, path: Path) -> None:
    """Decode ms per step and MB fetched per token against context, one panel per tier and batch."""
    plt = pyplot()

    cells = report["results"]
    tiers = sorted({c["tier"] for c in cells if c["tier"] != "memory"})
    batches = sorted({c["batch"] for c in cells})
    fig, axes = plt.subplots(2 * len(tiers), len(batches), figsize=(4.2 * len(batches), 3.4 * 2 * len(tiers)),
                             squeeze=False)  # fmt: skip
    for t, tier in enumerate(tiers):
        for b, batch in enumerate(batches):
            for metric, row, label in (
                ("ms_per_step", 2 * t, "ms per step"),
                ("bytes_per_token", 2 * t + 1, "MB/token"),
            ):
                ax = axes[row][b]
                for policy in report["policies"]:
                    where = "memory" if policy == "h2o" else tier
                    points = sorted((c["context"], c[metric]) for c in cells
                                    if (c["tier"], c["policy"], c["batch"]) == (where, policy, batch))  # fmt: skip
                    if points:
                        scale = 1e-6 if metric == "bytes_per_token" else 1.0
                        ax.plot([p[0] for p in points], [p[1] * scale for p in points], marker="o", label=policy)
                ax.set_title(f"{tier} tier, batch {batch}: {label}", fontsize=9)
                ax.set_xlabel("context (tokens)")
                ax.set_yscale("log")
                ax.legend(fontsize=7)
    fig.suptitle(f"{report['model']}, {report['dtype']}, {report['threads']} threads", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sparse_decode(report: dict, path: Path) -> None:
    """Sparse decode by context length: ms per token of full attention and InfiniGen's sparse decode, and the
    share of the rows the sparse layers read."""
    plt = pyplot()

    cells = sorted(report["results"], key=lambda c: c["context"])
    contexts = [c["context"] for c in cells]
    fig, (speed, read) = plt.subplots(1, 2, figsize=(9, 3.6))
    speed.plot(contexts, [c["full_ms"] for c in cells], marker="o", label="full attention")
    speed.plot(contexts, [c["sparse_ms"] for c in cells], marker="o", label="infinigen (sparse decode)")
    speed.set_xlabel("context (tokens)")
    speed.set_ylabel("ms per token (batch 1)")
    speed.legend(fontsize=8)
    read.plot(contexts, [100 * c["read_fraction"] for c in cells], marker="o", color="#d8733b")
    read.set_xlabel("context (tokens)")
    read.set_ylabel("% of rows read (sparse layers)")
    read.set_ylim(0, 100)
    fig.suptitle(f"{report['model']}, {report['dtype']}, {report['threads']} threads", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_window(report: dict, path: Path) -> None:
    """Window KV groups vs every layer full: KV per sequence at a long context, sequences at once in one KV memory."""
    plt = pyplot()

    configs = report["results"]["configurations"]
    names = [c["name"] for c in configs]
    colours = ["#3b7dd8", "#888888"]
    seq, conc = configs[0]["sequence"], configs[0]["concurrency"]
    context = seq["prompt_tokens"] + seq["new_tokens"]
    panels = [
        (f"KV per sequence in decode (MB), {context:,} tokens", [c["sequence"]["decode_bytes"] / 1e6 for c in configs]),
        (f"KV peak in prefill (MB), {context:,} tokens", [c["sequence"]["prefill_peak_bytes"] / 1e6 for c in configs]),
        (f"sequences at once, {conc['prompt_tokens'] + conc['max_tokens']:,} tokens in {report['kv_cache_memory']}",
         [c["concurrency"]["peak_running"] for c in configs]),
        ("output tokens/s (same requests)", [c["concurrency"]["output_tokens_per_s"] for c in configs]),
    ]  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.9))
    for ax, (title, values) in zip(axes, panels, strict=True):
        ax.bar(names, values, color=colours)
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
        for i, v in enumerate(values):
            ax.annotate(f"{v:.3g}", (i, v), ha="center", va="bottom", fontsize=8)
    fig.suptitle(
        f"{report['model']}, {report['dtype']}, {report['threads']} threads; {report['cpu']}", fontsize=9
    )  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_soak(report: dict, path: Path) -> None:
    """Soak run: /health latency and server memory over time, with the injected failures marked."""
    plt = pyplot()

    r = report["results"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    health = r["timeline"]["health"]
    top.plot([t for t, _, _ in health], [1000 * s for _, s, _ in health], ",", color="#3b7dd8")
    top.axhline(100, color="#c0392b", linewidth=0.8, linestyle="--", label="goal: 100 ms")
    top.set_ylabel("/health latency (ms)")
    top.set_yscale("log")
    top.legend(fontsize=8)
    rss = r["timeline"]["rss"]
    bottom.plot([t for t, _, _ in rss], [m for _, m, _ in rss], color="#3b7dd8", label="server")
    bottom.plot([t for t, _, _ in rss], [w for _, _, w in rss], color="#888888", label="prefill workers")
    bottom.set_ylabel("resident memory (MiB)")
    bottom.legend(fontsize=8)
    bottom.set_xlabel("seconds")
    for down, up in r["timeline"].get("restarts", []):  # the server was stopped on purpose: probes left out
        for ax in (top, bottom):
            ax.axvspan(down, up, color="#dddddd", zorder=0)
    for t, event in r["events"]:
        for ax in (top, bottom):
            ax.axvline(t, color="#e67e22", linewidth=0.8)
        top.annotate(event, (t, top.get_ylim()[1]), fontsize=7, va="top", rotation=90)
    fig.suptitle(
        f"soak: {r['requests']} requests, p99 /health {r['health']['p99_ms']:.1f} ms; "
        f"{report['model']}, {report['machine']['cpu']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tensor_parallel(report: dict, path: Path) -> None:
    """Per model and phase, each size's step time split into rank 0's all-reduce time and the rest."""
    plt = pyplot()

    models = report["models"]
    phases = list(next(iter(next(iter(models.values()))["costs"].values())))
    fig, axes = plt.subplots(len(models), len(phases), figsize=(4 * len(phases), 3.2 * len(models)), squeeze=False)
    for row, (model, result) in enumerate(models.items()):
        sizes = sorted(result["costs"], key=int)
        for col, phase in enumerate(phases):
            ax = axes[row][col]
            comm = [result["costs"][s][phase]["allreduce_ms"] for s in sizes]
            rest = [result["costs"][s][phase]["step_ms"] - c for s, c in zip(sizes, comm, strict=True)]
            labels = [f"{s} proc" for s in sizes]
            ax.bar(labels, rest, label="compute and the rest")
            ax.bar(labels, comm, bottom=rest, label="all-reduce (rank 0)")
            ax.set_title(f"{model}: {phase}", fontsize=9)
            ax.set_ylabel("step time (ms)")
            ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_kv_cache(report: dict, path: Path) -> None:
    """KV cache dtypes: decode tokens/s against context (a colour per dtype, a marker per batch size; llama.cpp
    dashed), sequences per GiB from the plan, and the measured peak beside the plan at the check's KV memory."""
    plt = pyplot()

    results = report["results"]
    colours = {d: f"C{i}" for i, d in enumerate(report["kv_cache_dtypes"])}
    panels = (["speed"] if "speed" in results else []) + (["per_gib", "check"] if "capacity" in results else [])
    if not panels:
        return
    widths = [1.6 if p == "speed" else 1.0 for p in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * sum(widths), 4.2), width_ratios=widths, squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "speed":
            _kv_speed_panel(ax, results["speed"]["cells"], colours)
        else:
            _kv_capacity_panel(ax, results["capacity"], colours, panel == "per_gib")
    fig.suptitle(
        f"{report['model']}, {report['dtype']} model, {report['threads']} threads; {report['cpu']}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _kv_speed_panel(ax, cells: list[dict], colours: dict[str, str]) -> None:  # noqa: ANN001 - a matplotlib Axes
    markers = {b: "osD^v"[i % 5] for i, b in enumerate(sorted({c["batch"] for c in cells}))}
    lines: dict[tuple, list[tuple[int, float]]] = {}
    for c in cells:
        key = (c["engine"], c["kv_cache_dtype"], c["kv_type"], c["batch"])
        lines.setdefault(key, []).append((c["context"], c["tokens_per_s"]))
    for (engine, dtype, kv_type, batch), points in lines.items():
        points.sort()
        ax.plot(
            [p[0] for p in points], [p[1] for p in points], marker=markers[batch], color=colours[dtype],
            linestyle="-" if engine == "kvserve" else "--", label=f"{engine} {kv_type}, B={batch}",
        )  # fmt: skip
    contexts = sorted({c["context"] for c in cells})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(contexts, [f"{c:,}" for c in contexts])
    ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("Decode speed by context", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def _kv_capacity_panel(ax, capacity: dict, colours: dict[str, str], per_gib: bool) -> None:  # noqa: ANN001 - Axes
    rows = capacity["dtypes"]
    dtypes = list(rows)
    if per_gib:
        values = [rows[d]["plan"]["sequences_per_gib"] for d in dtypes]
        ax.bar(dtypes, values, color=[colours[d] for d in dtypes])
        for i, v in enumerate(values):
            ax.annotate(f"{v}", (i, v), ha="center", va="bottom", fontsize=8)
        ax.set_title(f"sequences of {capacity['seq_len']:,} tokens per GiB (plan)", fontsize=10)
        return
    xs = range(len(dtypes))
    planned = [rows[d]["measured"]["planned_sequences"] for d in dtypes]
    measured = [rows[d]["measured"]["peak_running"] for d in dtypes]
    ax.bar([x - 0.2 for x in xs], planned, 0.4, color="#bbbbbb", label="plan")
    ax.bar([x + 0.2 for x in xs], measured, 0.4, color=[colours[d] for d in dtypes], label="peak running")
    for x, p, m in zip(xs, planned, measured, strict=True):
        ax.annotate(f"{p}", (x - 0.2, p), ha="center", va="bottom", fontsize=8)
        ax.annotate(f"{m}", (x + 0.2, m), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), dtypes)
    memory = capacity["check_kv_cache_memory"]
    size = f"{memory / 2**20:.1f} MiB" if memory >= 2**20 else f"{memory / 2**10:.1f} KiB"
    ax.set_title(f"sequences at once in {size} (run)", fontsize=10)
    ax.legend(fontsize=8)
