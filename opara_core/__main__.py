"""Command line: `python -m opara_core plan ...` and `python -m opara_core add-model ...`.

    python -m opara_core plan --dag DAG.json --policy P [--max-streams K]
        prints one JSON plan: {"policy", "num_streams", "stream", "order", "waits"}
    python -m opara_core plan --model NAME --policy P [--batch B] [--max-streams K] [--draw FILE.png|FILE.svg]
        traces a zoo model, plans it and prints a summary
    python -m opara_core add-model NAME --repository DIR (--export FILE.pt2 | --module MODULE:FACTORY --input ...)
        writes DIR/NAME (config.pbtxt, 1/model.py and the model's files) and lists what it wrote

Bad input gets one line, `error: ...`, on stderr: exit 2 for a wrong command line,
1 for a DAG file or model that cannot be planned; add-model exits 2 for any
model it cannot write. Never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from opara_core import parameters
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
    add = commands.add_parser("add-model", help="write a Triton model directory for a model of your own",
                              description="Write DIR/NAME: config.pbtxt and 1/ with model.py and the model's files.")
    add.add_argument("name", metavar="NAME")
    add.add_argument("--repository", required=True, type=Path, metavar="DIR", help="the model repository (created if missing)")
    route = add.add_mutually_exclusive_group(required=True)
    route.add_argument("--export", type=Path, metavar="FILE.pt2", help="a torch.export program with a dynamic batch dimension")
    route.add_argument("--module", metavar="MODULE:FACTORY", help="a callable returning the nn.Module (package.module:function or file.py:function); its weights are saved beside it")
    route.add_argument("--hf", type=Path, metavar="CHECKPOINT_DIR", help="a Hugging Face checkpoint directory (config.json and safetensors: BERT, RoBERTa, DistilBERT, ELECTRA, T5), served with variable lengths")
    add.add_argument("--input", action="append", default=[], metavar="NAME:DTYPE:DIMS[:LOW,HIGH]", help="with --module, each input per row, e.g. image:fp32:3x224x224 or ids:int64:16:0,30522")
    add.add_argument("--ids", action="append", default=[], metavar="NAME=LOW,HIGH", help="with --export, the valid ids of an integer input that indexes no embedding table directly")
    add.add_argument("--max-batch", type=positive_int, metavar="N", help="max_batch_size (default 32, or the program's limit)")
    add.add_argument("--precision", choices=parameters.get("precision").choices, help="the config's `precision` parameter (default: none, i.e. fp32; docs/precision.md)")
    add.add_argument("--force", action="store_true", help="replace DIR/NAME if it exists")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "add-model":
        return _add_model(args)
    if args.dag is not None and args.batch != 1:
        parser.error("--batch applies to --model only")
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


def _add_model(args: argparse.Namespace) -> int:
    from opara_core.serving.add_model import add_model  # imports torch
    from opara_core.serving.user_models import ModelFileError

    try:
        written = add_model(args.name, args.repository, export=args.export, module=args.module, hf=args.hf, inputs=tuple(args.input),
                            ids=tuple(args.ids), max_batch=args.max_batch, precision=args.precision, force=args.force)
    except (ModelFileError, OSError) as error:
        return fail(error, code=2)
    except Exception as error:  # noqa: BLE001 - one line, named
        log.debug("details", exc_info=True)
        return fail(error, code=2)
    for path in written:
        print(f"wrote {path}")
    print(f"serve it: make serve MODEL_REPOSITORY={args.repository}")
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
