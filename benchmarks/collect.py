"""Rebuild docs/benchmarks.md: the summary header (docs/benchmarks_summary.md) + every results file.

    python benchmarks/collect.py

Each benchmark script writes its measured table and command to benchmarks/results/<name>.md; this script
only concatenates them (headings demoted one level) so the figures live in one page.
"""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
ORDER = ["estimator_variance", "loss_kernels", "rollout_overhead", "adapter_rollout_overhead", "orchestration_overhead",
         "peak_memory", "reward_throughput", "memory_plan"]


def main() -> None:
    parts = [(ROOT / "docs" / "benchmarks_summary.md").read_text().rstrip() + "\n"]
    results = ROOT / "benchmarks" / "results"
    names = ORDER + sorted(p.stem for p in results.glob("*.md") if p.stem not in ORDER)
    for name in names:
        path = results / f"{name}.md"
        if not path.exists():
            continue
        lines, in_fence = [], False
        for ln in path.read_text().splitlines():
            if ln.startswith("```"):
                in_fence = not in_fence
            lines.append("#" + ln if ln.startswith("#") and not in_fence else ln)
        parts.append("\n".join(lines).rstrip() + f"\n\n(source: `benchmarks/results/{name}.md`)\n")
    out = ROOT / "docs" / "benchmarks.md"
    out.write_text("\n".join(parts))
    print(f"wrote {out.relative_to(ROOT)} from {len(parts) - 1} results files")


if __name__ == "__main__":
    main()
