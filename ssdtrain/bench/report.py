"""What ``ssdtrain bench`` prints (:func:`format_table`) and draws (:func:`plot`)."""

from __future__ import annotations

from ssdtrain.bench.modes import PEERS

__all__ = ["format_table", "plot"]


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"x{x:.2f}"


def _header(result: dict) -> list[str]:
    m, mach, drive = result["model"], result["machine"], result["drive"]
    lines = [
        f"model: {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads, seq {m['seq']}, "
        f"vocab {m['vocab']}, {m['params'] / 1e6:.1f}M params; batch {m['batch']}, {m['dtype']}, {m['device']}; "
        f"{m['steps']} timed steps per mode after 1 warm-up, modes alternated",
        f"machine: {mach['cpu']}, {mach['cpus']} CPUs, torch {mach['torch']}, {mach['date']}",
        f"input: {result['input']['backend']} pipeline",
    ]
    if mach.get("gpu"):
        lines.insert(2, f"gpu: {mach['gpu']} ({mach['device']}, {_fmt_bytes(mach['gpu_memory_bytes'])}), "
                        f"CUDA {mach['cuda']}; steps synchronized, forward/backward split by CUDA events")
    soc = result.get("save_on_cpu")
    if soc:
        lines.append(f"save_on_cpu: torch.autograd.graph.save_on_cpu(pin_memory={soc['pin_memory']}): {soc['note']}")
    if drive.get("write_gbps") is not None:
        probe = drive.get("probe") or [{}]
        io = "O_DIRECT" if all(p.get("direct_io") for p in probe) else "buffered"
        fs = ",".join(sorted({p.get("fs_type", "?") for p in probe}))
        lines.append(f"drive: {', '.join(drive['paths'])} ({fs}, {io}): raw write "
                     f"{drive['write_gbps']:.2f} GB/s, read {drive['read_gbps']:.2f} GB/s (probe, same run)")
        lines += [f"  warning: {w}" for w in drive.get("warnings", [])]
    elif result.get("offload"):
        lines.append(f"drive: {', '.join(drive['paths'])}: raw bandwidth unknown ({drive.get('error', 'no probe')})")
    if drive.get("limit"):
        from ssdtrain.bench.drive import DriveLimit

        limit = drive["limit"]
        lines.append("drive limit: " + DriveLimit(limit["gbps"], limit["method"], tuple(limit["devices"]),
                                                  limit["why"]).describe())
    backends = {o["backend"] for o in result.get("offload", {}).values()}
    for backend in sorted(backends):
        lines.append(f"offload backend: {backend}")
    return lines


def _on_gpu(result: dict) -> bool:
    return str(result["model"].get("device", "cpu")).startswith("cuda")


def _table(result: dict) -> list[str]:
    gpu = _on_gpu(result)
    memory = (("max alloc", "vs base", "peak saved", "vs base", "pinned host") if gpu
              else ("peak saved", "vs base", "peak RSS+", "vs base"))
    head = ("mode", "step", "vs base", *memory, "written", "read", "write GB/s", "read GB/s", "stall")
    rows = [head]
    for name, r in result["modes"].items():
        def bw(kind: str) -> str:
            if not r["written_bytes" if kind == "write" else "read_bytes"]:
                return "-"
            share = r[f"{kind}_share_of_drive"]
            return f"{r[f'{kind}_gbps']:.2f}" + (f" ({share:.0%})" if share is not None else "")
        if gpu:
            cells = (_fmt_bytes(r["max_memory_allocated_bytes"]), _ratio(r["max_memory_allocated_ratio"]),
                     _fmt_bytes(r["peak_saved_bytes"]), _ratio(r["peak_saved_ratio"]),
                     _fmt_bytes(r["pinned_host_peak_bytes"]))
        else:
            cells = (_fmt_bytes(r["peak_saved_bytes"]), _ratio(r["peak_saved_ratio"]),
                     _fmt_bytes(r["peak_rss_bytes"]), _ratio(r["peak_rss_ratio"]))
        rows.append((
            name, f"{r['step_time_s']:.3f}s", _ratio(r["step_time_ratio"]), *cells,
            _fmt_bytes(r["written_bytes"]) if r["written_bytes"] else "-",
            _fmt_bytes(r["read_bytes"]) if r["read_bytes"] else "-",
            bw("write"), bw("read"), f"{r['stall_s']:.3f}s" if "drive" in r else "-",
        ))
    return _columns(rows)


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for i, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def _spread(result: dict) -> list[str]:
    """How far single rounds strayed from the median ratio: on a GPU one mode's rounds ranged
    x1.02-1.60 while another's stayed within x0.97-1.22 (H100, 2026-11-24)."""
    spans, rounds = [], 0
    for name, row in result["modes"].items():
        ratios = row.get("step_time_ratios") or []
        if name != "baseline" and len(ratios) >= 2:
            spans.append(f"{name} x{min(ratios):.2f}-{max(ratios):.2f}")
            rounds = max(rounds, len(ratios))
    return [f"vs base per round (min-max over {rounds} rounds): " + ", ".join(spans)] if spans else []


def _versus(result: dict) -> list[str]:
    """Each mode against the peers without ssdtrain that ran (baseline, recompute, save_on_cpu):
    step time, and peak memory (device memory on a GPU, saved bytes on the CPU)."""
    modes = result["modes"]
    peers = [p for p in PEERS if p in modes]
    if peers in ([], ["baseline"]):  # the table's "vs base" columns say it all
        return []
    key, label = (("max_memory_allocated_ratio", "max alloc") if _on_gpu(result)
                  else ("peak_saved_ratio", "saved"))
    rows = [("vs (row / column)", *(f"{p} step" for p in peers), *(f"{p} {label}" for p in peers))]
    for name, row in modes.items():
        vs = row.get("vs") or {}
        if name != "baseline" and vs:
            rows.append((name, *(_ratio(vs[p]["step_time_ratio"]) if p in vs else "" for p in peers),
                         *(_ratio(vs[p][key]) if p in vs else "" for p in peers)))
    return _columns(rows) if len(rows) > 1 else []


def _drive_lines(result: dict) -> list[str]:
    lines = []
    for name, r in result["modes"].items():
        d = r.get("drive")
        if d is None:
            continue
        raw = d.get("raw_write_gbps")
        limit = f"; limited to {d['limit_gbps']:g} GB/s each way" if d.get("limit_gbps") else ""
        raw_text = (f"the drive's raw write {raw:.2f}, read {d['raw_read_gbps']:.2f} GB/s (probe){limit}"
                    if raw is not None else f"the drive's raw rates unknown{limit}")
        achieved = (f"  achieved write {r['write_gbps']:.2f}, read {r['read_gbps']:.2f} GB/s over the step; "
                    + raw_text)
        if d["capacity_bytes"] is None:
            lines += [f"{name}: moved {_fmt_bytes(d['moved_bytes'])}/step; drive rates unknown, so no capacity",
                      achieved]
            continue
        waited = f"; then, untimed, its writes still in flight took {d['wait_s']:.3f}s" if d.get("wait_s") else ""
        lines += _peak_lines(name, d)
        lines += [f"  drive could carry {_fmt_bytes(d['capacity_bytes'])}/step, moved (written) "
                  f"{_fmt_bytes(d['moved_bytes'])} ({d['moved_share']:.0%})",
                  f"  = min(write {d['write_gbps']:.2f} GB/s x forward {d['forward_s']:.3f}s, "
                  f"read {d['read_gbps']:.2f} GB/s x backward {d['backward_s']:.3f}s{waited})", achieved]
        made = f"{d['made_per']}'s forward makes {d['made_gbps']:.2f} GB/s of activations"
        if d["drive_limited"]:
            lines.append(f"  regime: drive slower than forward makes activations ({made}, the drive writes "
                         f"{d['write_gbps']:.2f}): drive-limited")
        else:
            lines.append(f"  regime: drive faster than forward makes activations ({made}, the drive writes "
                         f"{d['write_gbps']:.2f})")
    return lines


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _peak_lines(name: str, d: dict) -> list[str]:
    """The headline: the peak's fall, of what the drive could take before the peak."""
    if d.get("peak_fall_bytes") is None:
        return [f"{name}:"]
    line = (f"{name}: the peak fell by {_fmt_bytes(d['peak_fall_bytes'])} ({_share(d['peak_fall_share'])} of the "
            f"saved bytes)")
    if d.get("possible_bytes") is None:
        return [line + "; the drive's rate unknown, so no bound"]
    line += f", {_share(d['of_possible'])} of the possible {_fmt_bytes(d['possible_bytes'])}"
    lines = [line, f"  possible = min(write {d['write_gbps']:.2f} GB/s x forward {d['forward_ref_s']:.3f}s, saved)"]
    if d.get("possible_in_time_bytes") is not None:
        lines[-1] += (f"; of what forward saves in time to be written before it ends, {_fmt_bytes(d['possible_in_time_bytes'])}: "
                      f"{_share(d['of_possible_in_time'])}")
    return lines


def format_table(result: dict) -> str:
    """The human-readable report ``ssdtrain bench`` prints."""
    lines = _header(result) + [""] + _table(result) + _spread(result)
    versus = _versus(result)
    if versus:
        lines += [""] + versus
    drive = _drive_lines(result)
    if drive:
        lines += [""] + drive
    if _on_gpu(result):
        memory = ("max alloc: torch.cuda.max_memory_allocated over one step, each mode alone in a child process "
                  "(weights, gradients, optimizer state, batch and activations); peak saved: the activation peak, "
                  "saved-activation bytes in GPU memory; pinned host: the pinned host allocator's peak in that step")
    else:
        memory = ("peak saved: saved-activation bytes in memory; peak RSS+: resident set growth within a step "
                  "(measured in a child process)")
    lines += ["", "step: median; vs base (step): median over rounds of the ratio to baseline's step in the same "
              f"round; {memory}; written/read: per step; GB/s: per step time (share of the drive's); "
              "vs (row / column): the same ratios against each peer"]
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Saved-activation bytes over one step per mode, forward and backward marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timelines = result["timeline"]
    fig, axes = plt.subplots(len(timelines), 1, figsize=(8, 2.4 * len(timelines)), squeeze=False)
    for ax, (name, tl) in zip(axes[:, 0], timelines.items()):
        pts = list(tl["points"]) + [(tl["step_end"], tl["points"][-1][1] if tl["points"] else 0)]
        xs = [p[0] for p in pts]
        ys = [p[1] / 2**20 for p in pts]
        ax.step(xs, ys, where="post", color="C0")
        ax.axvspan(0, tl["forward_end"], color="C2", alpha=0.12, label="forward")
        ax.axvspan(tl["forward_end"], tl["backward_end"], color="C3", alpha=0.12, label="backward")
        ax.set_title(name, loc="left", fontsize=10)
        ax.set_ylabel("saved MiB")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since step start")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
