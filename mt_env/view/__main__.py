"""``python -m mt_env.view RUN_DIR``: build the run's trajectory viewer, print its path and open it in a browser."""

from __future__ import annotations

import argparse
import sys
import webbrowser

from . import build


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mt_env.view", description=__doc__.split(":")[1].strip())
    ap.add_argument("run_dir", help="a run's output_dir (trajectories/ and metrics.jsonl)")
    ap.add_argument("--out", default=None, help="where to write the page (default: RUN_DIR/viewer)")
    ap.add_argument("--no-open", action="store_true", help="only build and print the path")
    args = ap.parse_args(argv)
    try:
        index = build(args.run_dir, args.out)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(index.resolve())
    if not args.no_open:
        webbrowser.open(index.resolve().as_uri())
    return 0


if __name__ == "__main__":
    sys.exit(main())
