"""The ``pdserve`` console script.

``pdserve serve [flags]``  engine server (this package; ``python -m pdserve.engine`` is the same)
``pdserve router [flags]`` the router (``pdserve.router.cli``)
``pdserve launch [flags]`` prefill + decode servers + router on this machine (``pdserve.entrypoints.cluster``)
``pdserve profile|plan|planner [flags]`` measure servers, advise counts, scale the pools (``pdserve.entrypoints.planner.cli``)

The flags of ``serve`` are in ``flags.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from pdserve.entrypoints.flags import build_serve_parser, parse_serve_args


def serve_main(argv: list[str]) -> int:
    try:
        config = parse_serve_args(argv)
    except ValueError as e:
        print(f"pdserve serve: error: {e}", file=sys.stderr)
        return 2
    from pdserve.entrypoints.serve import run_server

    return run_server(config)


def launch_main(argv: list[str], make_planner: Callable | None = None) -> int:
    from pdserve.entrypoints.launch import run_launch
    from pdserve.entrypoints.launch_flags import parse_launch_args

    try:
        config = parse_launch_args(argv, build_serve_parser, make_planner)
    except ValueError as e:
        print(f"pdserve launch: error: {e}", file=sys.stderr)
        return 2
    return run_launch(config, make_planner)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: pdserve {serve,router,launch,profile,plan,planner} [flags]   (pdserve <command> --help for its flags)"
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return serve_main(rest)
    if command == "router":
        from pdserve.router.cli import main as router_main

        return router_main(rest) or 0
    if command == "launch":
        from pdserve.entrypoints.planner import launch_planner

        return launch_main(rest, launch_planner.launch_planner)
    if command in ("profile", "plan", "planner"):
        from pdserve.entrypoints.planner import cli as planner_cli

        if command == "profile":
            return planner_cli.profile_main(rest, build_serve_parser)
        return planner_cli.plan_main(rest) if command == "plan" else planner_cli.planner_main(rest, build_serve_parser)
    print(f"pdserve: unknown command {command!r}\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
