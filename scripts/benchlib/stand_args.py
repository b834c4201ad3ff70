"""The flags every PD-stand benchmark takes for the servers it starts and the line it writes."""

from __future__ import annotations

import argparse


def add_stand_args(p: argparse.ArgumentParser) -> None:
    """``--model-path``, ``--transfer-backend``, ``--seed``, ``--output-file``, ``--startup-timeout``:
    the same names and defaults in every script that starts prefill and decode servers."""
    p.add_argument("--model-path", default=None)
    p.add_argument("--transfer-backend", default="mooncake", choices=("mooncake", "nixl"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None, help="append the JSON line here too")
    p.add_argument("--startup-timeout", type=float, default=600.0)
