"""`fmserve keys DIR`: CURVE key pairs for a service bound beyond loopback (ipc/curve.py), and
the flags with which clients (`fmserve client`, `fmserve top`) use them."""

from __future__ import annotations

import argparse

from ipc.curve import DEFAULT_CLIENT, CurveClient, curve_client, write_keys


def add_keys_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="where to write them (made if missing; the server pair is kept "
                               "if there is one)")
    p.add_argument("--client", default=DEFAULT_CLIENT, metavar="NAME",
                   help=f"name of the new client key pair (default {DEFAULT_CLIENT}); run again "
                        f"with another name for each further client")


def run_keys(args: argparse.Namespace) -> int:
    for path in write_keys(args.dir, args.client):
        print(f"wrote {path}")
    print(f"service: set service.curve_keys = \"{args.dir}\" (fmserve serve --curve-keys "
          f"{args.dir}); it admits the client public keys in {args.dir}/clients/, read at start.\n"
          f"client {args.client}: copy {args.dir}/server.key and {args.dir}/{args.client}"
          f".key_secret into one directory and give it as --curve-keys (and --curve-client "
          f"{args.client}); keep the .key_secret files private")
    return 0


def add_curve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--curve-keys", default=None, metavar="DIR",
                   help="the service runs CURVE (service.curve_keys): a directory holding its "
                        "server.key and this client's key pair, from `fmserve keys`")
    p.add_argument("--curve-client", default=DEFAULT_CLIENT, metavar="NAME",
                   help=f"whose key pair in --curve-keys: NAME.key_secret (default "
                        f"{DEFAULT_CLIENT})")


def curve_from_args(args: argparse.Namespace) -> CurveClient | None:
    return curve_client(args.curve_keys, args.curve_client) if args.curve_keys else None
