"""How long planning takes: every policy on a NASNet-sized DAG (1,200+ kernels).

    python scripts/plan_speed.py                       # trace the zoo's nasnet (takes minutes)
    python scripts/plan_speed.py --dag nasnet.json     # a saved DAG file (see --save-dag)

Each timed run starts from a fresh Dag (read back from JSON), so cached graph helpers
such as the transitive reduction are paid for in every run, as a cold planner would.
Prints a table and writes JSON. The target is at most 1 s per policy.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

from opara_core.planning import policies
from opara_core.planning.dag import Dag
from opara_core.planning.plan import make_plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--dag", help="a DAG file instead of tracing --model")
    source.add_argument("--model", default="nasnet", help="zoo model to trace (default nasnet)")
    parser.add_argument("--save-dag", help="write the traced DAG here for later runs")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per policy (default 5)")
    parser.add_argument("--max-streams", type=int, nargs="*", default=[0, 8], help="budgets; 0 = none (default: 0 8)")
    parser.add_argument("--out", default="out/plan_speed.json", help="JSON results (default out/plan_speed.json)")
    args = parser.parse_args()

    if args.dag:
        data = json.loads(Path(args.dag).read_text())
        source_name = args.dag
    else:
        from opara_core.engine.trace import trace_zoo

        start = time.perf_counter()
        data = trace_zoo(args.model).dag.to_json()
        print(f"traced {args.model} in {time.perf_counter() - start:.1f} s")
        source_name = args.model
        if args.save_dag:
            Path(args.save_dag).write_text(json.dumps(data))
    dag = Dag.from_json(data)
    print(f"{source_name}: {len(dag)} kernels, {len(dag.edges)} edges, {len(dag.reduced_edges)} after reduction\n")

    rows = []
    for policy in policies.names():
        for budget in args.max_streams:
            k = budget or None
            make_plan(Dag.from_json(data), policy, k)  # warm-up
            times, plan = [], None
            for _ in range(args.repeat):
                fresh = Dag.from_json(data)
                start = time.perf_counter()
                plan = make_plan(fresh, policy, k)
                times.append(time.perf_counter() - start)
            rows.append(
                {
                    "policy": policy,
                    "max_streams": k,
                    "streams": plan.num_streams,
                    "waits": len(plan.waits),
                    "estimated_us": round(plan.estimated_us, 1),
                    "critical_path_us": round(plan.critical_path_us, 1),
                    "median_ms": round(statistics.median(times) * 1e3, 1),
                    "max_ms": round(max(times) * 1e3, 1),
                }
            )

    header = f"{'policy':<11}{'budget':>7}{'streams':>9}{'waits':>7}{'est. us':>10}{'median ms':>11}{'max ms':>9}"
    print(header)
    print("-" * len(header))
    for r in rows:
        budget = "-" if r["max_streams"] is None else r["max_streams"]
        print(
            f"{r['policy']:<11}{budget:>7}{r['streams']:>9}{r['waits']:>7}{r['estimated_us']:>10.1f}"
            f"{r['median_ms']:>11.1f}{r['max_ms']:>9.1f}"
        )
    worst = max(r["max_ms"] for r in rows)
    print(f"\nslowest run {worst:.1f} ms: {'within' if worst <= 1000 else 'OVER'} the 1 s target")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "source": source_name,
        "kernels": len(dag),
        "edges": len(dag.edges),
        "reduced_edges": len(dag.reduced_edges),
        "critical_path_us": dag.critical_path_us,
        "repeat": args.repeat,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "python": platform.python_version(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "rows": rows,
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
