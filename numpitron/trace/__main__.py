"""python -m numpitron.trace summary FILE.json [--json]   where each rank's step went"""

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
    args = parser.parse_args(argv)
    rows = summarize(load(args.trace))
    print(json.dumps(rows, indent=1) if args.json else text(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
