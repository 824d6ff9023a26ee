"""`fmserve top`: the live monitor of a running service (see tui/app.py)."""

from __future__ import annotations

import argparse
import os

from fmserve.arg_types import endpoint
from fmserve.keys_cmd import add_curve_args, curve_from_args
from ipc.client_messages import ADMIN_TOKEN_ENV


def add_top_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5557", type=endpoint,
                   help="the service's client endpoint (used to abort requests)")
    p.add_argument("--telemetry-endpoint", default="tcp://127.0.0.1:5558", type=endpoint,
                   help="where the service publishes telemetry ([service] telemetry_endpoint)")
    p.add_argument("--refresh", type=float, default=0.25,
                   help="seconds between screen updates (default 0.25)")
    p.add_argument("--stale-after", type=float, default=2.0,
                   help="seconds without a snapshot before the service is shown as down")
    p.add_argument("--admin-token", default=os.environ.get(ADMIN_TOKEN_ENV, ""),
                   help=f"the service's service.admin_token, needed to abort requests "
                        f"(default: ${ADMIN_TOKEN_ENV}; prefer it: a flag shows in ps)")
    add_curve_args(p)


def run_top(args: argparse.Namespace) -> int:
    if args.refresh <= 0 or args.stale_after <= 0:
        raise ValueError("--refresh and --stale-after must be > 0 seconds")
    from tui.app import TopApp
    TopApp(args.telemetry_endpoint, args.endpoint, refresh_s=args.refresh,
           stale_after_s=args.stale_after, admin_token=args.admin_token,
           curve=curve_from_args(args)).run()
    return 0
