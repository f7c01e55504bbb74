"""python -m numpitron.trace summary FILE.json [--json]        where each rank's step went
python -m numpitron.trace draw FILE.json OUT.svg [--iteration N]   one step of every rank, drawn
                                                                   (matplotlib: the docs extra)
python -m numpitron.trace compare MEASURED PREDICTED [--json]      where a run and the planner's
                                                                   prediction (plan --trace) part"""

import argparse
import json
import sys

from numpitron.trace.summary import load, summarize, text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m numpitron.trace", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    summary = commands.add_parser("summary", help="per rank and iteration: computation, exposed and hidden "
                                                  "communication by group, idle time, and their shares")
    summary.add_argument("trace", metavar="FILE.json")
    summary.add_argument("--json", action="store_true", help="the same as JSON, one object per rank and iteration")
    drawing = commands.add_parser("draw", help="one traced step of every rank as a figure (matplotlib)")
    drawing.add_argument("trace", metavar="FILE.json")
    drawing.add_argument("out", metavar="OUT.svg")
    drawing.add_argument("--iteration", type=int, help="the traced iteration to draw (default: the first)")
    drawing.add_argument("--title")
    comparing = commands.add_parser("compare", help="a measured trace against the planner's predicted one "
                                                    "(python -m numpitron.plan ... --trace)")
    comparing.add_argument("measured", metavar="MEASURED.json")
    comparing.add_argument("predicted", metavar="PREDICTED.json")
    comparing.add_argument("--iteration", type=int, help="the measured iteration (default: the first traced)")
    comparing.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "compare":
        from numpitron.trace.compare import compare, text as compare_text
        rows = compare(load(args.measured), load(args.predicted), args.iteration)
        print(json.dumps(rows, indent=1) if args.json else compare_text(rows))
        return 0
    if args.command == "draw":
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("draw needs matplotlib: pip install -e '.[docs]'")
        from numpitron.trace.draw import draw
        try:
            draw(load(args.trace), args.out, args.iteration, args.title)
        except ValueError as error:
            parser.error(str(error))
        return 0
    rows = summarize(load(args.trace))
    print(json.dumps(rows, indent=1) if args.json else text(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
