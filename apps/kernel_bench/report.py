"""The final table, from the report alone (also what a respawned process merged in)."""

from __future__ import annotations

from tables import format_table

from kernel_bench.steps import STEP_CONTEXT
from kernel_bench.timing import best_us


def fmt(x: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def fmt_err(res: dict | None) -> str:
    if not res:
        return "-"
    if "error" in res:
        return "ERR"
    if "err" not in res:
        return "-"
    return f"{res['err']:.1e}" + ("" if res.get("ok") else " BAD")


def fmt_impl(res: dict) -> str:
    if "error" in res:
        return res["error"]
    parts = [f"graph {fmt(res.get('graph_us'))} µs", f"eager {fmt(res.get('eager_us'))} µs"]
    parts += [f"{k} {res[k]:.3g}" for k in ("tbs", "tflops", "gbs", "err") if res.get(k) is not None]
    parts += [] if res.get("ok", True) else ["WRONG"]
    return ", ".join(parts)


def best_fa4(impls: dict) -> tuple[str | None, dict | None]:
    timed = [(best_us(r), k, r) for k, r in impls.items() if k.startswith("fa4") and best_us(r)]
    if not timed:
        return None, impls.get("fa4")
    _, label, res = min(timed, key=lambda x: x[0])
    return label, res


def ratio(fa4: dict | None, ours: dict | None) -> str:
    """ours / FA4 throughput: graph to graph when both were captured, else eager to eager."""
    if not fa4 or not ours:
        return "-"
    key = "graph_us" if "graph_us" in fa4 and "graph_us" in ours else "eager_us"
    if key not in fa4 or key not in ours:
        return "-"
    return f"{fa4[key] / ours[key]:.2f}x" + ("" if key == "graph_us" else " (eager)")


def summary(report: dict) -> str:
    env = report["env"]
    lines = ["", "== bench_kernels summary =="]
    lines.append(
        f"{env.get('gpu')}; torch {env.get('torch')} (cuda {env.get('cuda')}), triton {env.get('triton')}, "
        f"FA4 {env.get('flash_attn_4')}"
    )
    c = report["ceilings"]
    if c:
        lines.append(
            f"ceilings: copy {c['copy_tbs']:.2f} TB/s (read + write, {c['copy_buffer_bytes'] / 1e9:.1f} GB buffers), "
            f"bf16 matmul {c['matmul_n']}^3 {c['matmul_tflops']:.0f} TFLOP/s"
        )
    if report["store_kv"]:
        rows = [["store_kv", "graph µs", "eager µs", "GB/s", "%copy", "check"]]
        for r in report["store_kv"]:
            check = "ERR" if "error" in r else ("ok" if r.get("ok") else "BAD")
            rows.append([
                f"T={r['tokens']}", fmt(r.get("graph_us")), fmt(r.get("eager_us")), fmt(r.get("gbs"), ".0f"),
                fmt(r.get("frac_copy") and 100 * r["frac_copy"], ".0f"), check,
            ])  # fmt: skip
        lines += ["", *format_table(rows)]
    for kind, unit, key, frac in (("decode", "TB/s", "tbs", "%copy"), ("prefill", "TFLOP/s", "tflops", "%mm")):
        cases = [r for r in report["attention"] if r["kind"] == kind]
        if not cases:
            continue
        head = [kind, "bs", "ours µs", "eager", unit, frac, "fa4 µs", "eager", unit, "fa4", "ours/fa4",
                "err ours", "err fa4"]  # fmt: skip
        rows = [head]
        for r in cases:
            ours = r["impls"].get("ours")
            label, fa4 = best_fa4(r["impls"])
            f = (ours or {}).get("frac_copy" if kind == "decode" else "frac_matmul")
            rows.append([
                r["case"], str(r["block_size"]), fmt(best_us(ours)), fmt((ours or {}).get("eager_us")),
                fmt((ours or {}).get(key), ".2f" if kind == "decode" else ".0f"), fmt(f and 100 * f, ".0f"),
                fmt(best_us(fa4)), fmt((fa4 or {}).get("eager_us")),
                fmt((fa4 or {}).get(key), ".2f" if kind == "decode" else ".0f"), label or "-",
                ratio(fa4, ours), fmt_err(ours), fmt_err(fa4),
            ])  # fmt: skip
        lines += ["", *format_table(rows)]
    if report["attention"]:
        lines.append("(µs: per call in a graph replay, else eager; eager: do_bench median, host overhead included)")
    if report["steps"]:
        rows = [
            [
                f"decode step (ctx {STEP_CONTEXT})",
                "B",
                "eager ms",
                "graph ms",
                "tok/s",
                "floor ms",
                "%floor",
                "eager/graph",
            ]
        ]
        for backend, batch in dict.fromkeys((r["backend"], r["batch"]) for r in report["steps"]):
            by_mode = {r["mode"]: r for r in report["steps"] if (r["backend"], r["batch"]) == (backend, batch)}
            e, g = by_mode.get("eager", {}).get("ms"), by_mode.get("graph", {}).get("ms")
            best = min((x for x in (e, g) if x), default=None)
            floor = next((r.get("floor_ms") for r in by_mode.values() if r.get("floor_ms")), None)
            no_graphs = "graph" in by_mode and not by_mode["graph"].get("cuda_graphs", True)
            rows.append([
                backend, str(batch), fmt(e, ".3f"), fmt(g, ".3f", "*" if no_graphs else ""),
                fmt(best and batch / best * 1e3, ".0f"),
                fmt(floor, ".3f"), fmt(floor and best and 100 * floor / best, ".0f"), fmt(e and g and e / g, ".2f"),
            ])  # fmt: skip
        lines += ["", *format_table(rows)]
        if any(r["mode"] == "graph" and not r.get("cuda_graphs", True) for r in report["steps"]):
            lines.append("(* no CUDA graphs were captured: enforce_eager=False ran eagerly)")
    if report["prefill"]:
        rows = [["prefill step", "tokens", "ms", "tok/s", "floor ms", "%floor"]]
        for r in report["prefill"]:
            ms, floor = r.get("ms"), r.get("floor_ms")
            rows.append([
                r["backend"], str(r["tokens"]), fmt(ms, ".2f"), fmt(r.get("tok_s"), ".0f"), fmt(floor, ".2f"),
                fmt(ms and floor and 100 * floor / ms, ".0f"),
            ])  # fmt: skip
        lines += ["", *format_table(rows)]
    if report.get("moe"):
        lines += ["", *moe_table(report["moe"])]
    for name, why in report["skipped"].items():
        lines.append(f"skipped {name}: {why}")
    if report["errors"]:
        lines += ["", "errors:"] + [f"  {uid}: {msg[:200]}" for uid, msg in report["errors"].items()]
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


def moe_table(rows: list[dict]) -> list[str]:
    """The "moe" section: per shape and token count, the fused kernel (the table's tile, the sweep's best) and
    the torch path, each against the floor (experts' bytes at the copy bandwidth, or FLOPs at the matmul rate)."""
    table = [["moe layer", "T", "floor µs", "fused µs", "%floor", "best tile µs", "best tile", "torch µs", "%floor",
              "fused/torch", "err fused", "err torch"]]  # fmt: skip
    for r in rows:
        fused, torch_ = r["impls"].get("fused"), r["impls"].get("torch")
        tiles = [
            (best_us(v), k) for k, v in r["impls"].items() if k.startswith("fused[") and v.get("ok") and best_us(v)
        ]
        best_t, best = min(tiles) if tiles else (None, "-")
        floor = r.get("floor_us")
        f, t = best_us(fused), best_us(torch_)
        table.append([
            r["shape"], str(r["tokens"]), fmt(floor), fmt(f), fmt(floor and f and 100 * floor / f, ".0f"),
            fmt(best_t), (best or "-").removeprefix("fused"), fmt(t), fmt(floor and t and 100 * floor / t, ".0f"),
            fmt(f and t and t / f, ".2f", "x"), fmt_err(fused), fmt_err(torch_),
        ])  # fmt: skip
    return [*format_table(table), "(µs: per call in a graph replay, else eager; floor: the experts touched, read once)"]


def best_tile(row: dict) -> tuple[float | None, str | None]:
    """The fastest checked fused tile of a "moe" row (what to put in kernels/fused_moe.py's TILES): (µs, label)."""
    timed = [(best_us(v), k) for k, v in row["impls"].items() if k.startswith("fused[") and v.get("ok") and best_us(v)]
    return min(timed) if timed else (None, None)
