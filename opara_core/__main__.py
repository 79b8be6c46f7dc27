"""Command line: `python -m opara_core plan ...`.

    python -m opara_core plan --dag DAG.json --policy P [--max-streams K]
        prints one JSON plan: {"policy", "num_streams", "stream", "order", "waits"}
    python -m opara_core plan --model NAME --policy P [--batch B] [--max-streams K] [--draw FILE.png|FILE.svg]
        traces a zoo model, plans it and prints a summary

Bad input gets one line, `error: ...`, on stderr: exit 2 for a wrong command line,
1 for a DAG file or model that cannot be planned. Never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from opara_core.cli_helpers import Parser, fail, positive_int
from opara_core.planning import order as orders
from opara_core.planning import policies
from opara_core.planning.dag import Dag
from opara_core.planning.plan import make_plan

log = logging.getLogger("opara_core")


def _parser() -> Parser:
    parser = Parser(prog="python -m opara_core", description="Plan multi-stream schedules for PyTorch models.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan = commands.add_parser("plan", help="plan a DAG file or a zoo model", description="Plan a DAG file or a zoo model.")
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--dag", metavar="DAG.json", help="a DAG file ('-' for stdin); prints the plan as JSON")
    source.add_argument("--model", metavar="NAME", help="a zoo model; prints a summary")
    plan.add_argument("--policy", required=True, choices=policies.names())
    plan.add_argument("--max-streams", type=positive_int, metavar="K", help="at most K streams (default: no limit)")
    plan.add_argument("--order", choices=list(orders.ORDERS), help="launch order (default: the policy's own)")
    plan.add_argument("--batch", type=positive_int, default=1, metavar="B", help="batch size for --model costs (default 1)")
    plan.add_argument("--draw", metavar="FILE.png|FILE.svg", help="render the DAG marked by stream (SVG: with a tooltip per operator)")
    plan.add_argument("--out", metavar="PLAN.json", help="also write the full plan as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.dag is not None and args.batch != 1:
        parser.error("--batch applies to --model only")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _plan(args)
    except Exception as e:  # one line, no traceback, whatever went wrong
        log.debug("details", exc_info=True)
        return fail(e)


def _plan(args: argparse.Namespace) -> int:
    if args.dag is not None:
        dag = _read_dag(args.dag)
        plan = make_plan(dag, args.policy, args.max_streams, args.order)
        print(json.dumps(plan.contract_json()))
    else:
        from opara_core.engine.interpreter import plan_graph  # imports torch: only for models
        from opara_core import zoo
        from opara_core.engine.trace import trace_model

        entry = zoo.get(args.model)
        graph = trace_model(entry, entry.build(), batch=args.batch)
        dag = graph.dag
        plan = plan_graph(graph, args.policy, args.max_streams, args.order)
        print(f"model           {args.model} (batch {args.batch})")
        print(plan.summary())
    if args.out:
        Path(args.out).write_text(json.dumps(plan.to_json(), indent=1) + "\n")
    if args.draw:
        from opara_core.draw import draw  # matplotlib: only when drawing

        draw(dag, plan, args.draw)
        if args.model is not None:
            print(f"drawing         {args.draw}")
    return 0


def _read_dag(path: str) -> Dag:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as e:
        raise ValueError(f"cannot read DAG file {path!r}: {e.strerror or e}") from None
    try:
        data: Any = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"DAG file {path!r} is not valid JSON: {e}") from None
    return Dag.from_json(data)


if __name__ == "__main__":
    raise SystemExit(main())
