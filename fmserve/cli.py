"""`fmserve` command line: the composition root, the one place that wires ipc, service and gpu.

    fmserve generate --prompt "Hello"          one prompt, streamed
    fmserve generate --chat                    interactive chat
    fmserve generate --file prompts.jsonl      a batch; one JSON line out per prompt
    fmserve serve                              the service (config.toml + flags)
    fmserve client --prompt "Hello"            ask a running service
    fmserve top                                live monitor of a running service
    fmserve keys DIR                           CURVE keys for a service beyond loopback
    fmserve bench offline                      prefill/decode tokens/s vs transformers
    fmserve bench offline --spec chain,tree    EAGLE speculative decoding vs the plain engine
    fmserve bench serve                        the service under load vs the offline engine
    fmserve bench http                         the OpenAI HTTP API vs ZMQ, same load, one run
    fmserve bench peers [--quick]              fmserve vs transformers / llama.cpp, report + plots
    fmserve bench prefix                       the prefix cache off and on (system prompt, chat)
    fmserve bench soak                         minutes of hostile load: nothing lost, back to idle
    fmserve train-eagle                        train an EAGLE-3 draft head (self-distilled)
"""

from __future__ import annotations

import argparse
import os
import sys

from fmserve.arg_types import add_runtime_args, batch_limit, positive_int, positive_int_list
from gpu.cpu_info import torch_isa_env


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and runtime")
    add_runtime_args(g)
    g.add_argument("--page-size", type=positive_int, default=16, help="tokens per KV page (>= 1)")
    g.add_argument("--max-kv-tokens", type=positive_int, default=65536,
                   help="KV cache size in tokens")
    g.add_argument("--max-running-requests", type=positive_int, default=64)
    g.add_argument("--max-tokens-per-step", type=positive_int, default=2048,
                   help="token budget of one forward (decodes + prefill chunk)")
    s = p.add_argument_group("speculative decoding (EAGLE)")
    s.add_argument("--spec-algorithm", default="none", choices=["none", "eagle3", "eagle"])
    s.add_argument("--draft-model", default="",
                   help="EAGLE head directory (default: the head shipped for the default model)")
    s.add_argument("--spec-num-steps", type=int, default=4)
    s.add_argument("--spec-topk", type=int, default=1)
    s.add_argument("--spec-num-draft-tokens", type=int, default=5)
    s.add_argument("--spec-disable-above-batch-size", type=batch_limit, default="auto",
                   help="decode batches larger than this run without drafting (0: never; "
                        "auto: where measured faster)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def named_commands(argv: list[str] | None) -> tuple[str | None, str | None]:
    """The command `argv` names and, for `bench`, its bench command (None where it names none:
    `fmserve --help`)."""
    words = list(argv or [])
    command = words[0] if words and not words[0].startswith("-") else None
    bench = words[1] if command == "bench" and len(words) > 1 and not words[1].startswith(
        "-") else None
    return command, bench


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """Every command is listed; only the one `argv` names gets its arguments and imports its
    modules (all of them when `argv` is None), so `fmserve serve` runs without the benchmarks'
    and the monitor's modules in its memory."""
    named, named_bench = named_commands(argv)

    def wants(command: str, bench: str | None = None) -> bool:
        return (named in (None, command)
                and (bench is None or named_bench in (None, bench)))

    parser = argparse.ArgumentParser(prog="fmserve", description="a small LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="run the model in this process (no service)")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one user message (rendered with the chat template)")
    src.add_argument("--chat", action="store_true", help="interactive multi-turn chat")
    src.add_argument("--file", help="JSONL file: each line has 'prompt' or 'messages'")
    gen.add_argument("--raw", action="store_true",
                     help="feed --prompt / file prompts as plain text, without the chat template")
    gen.add_argument("--system", default=None, help="system message for --prompt / --chat")
    gen.add_argument("--output", default="-", help="where --file results go (JSONL; - = stdout)")
    add_model_args(gen)
    add_sampling_args(gen)
    if wants("generate"):
        from fmserve.generate_cmd import run_generate
        gen.set_defaults(func=run_generate)

    serve = sub.add_parser("serve", help="run the service (scheduler + worker processes)")
    if wants("serve"):
        from fmserve.serve_cmd import add_serve_args, run_serve
        add_serve_args(serve)
        serve.set_defaults(func=run_serve)

    client = sub.add_parser("client", help="send requests to a running service")
    if wants("client"):
        from fmserve.client_cmd import add_client_args, run_client
        add_client_args(client)
        add_sampling_args(client)
        client.set_defaults(func=run_client)

    top = sub.add_parser("top", help="live monitor of a running service")
    if wants("top"):
        from fmserve.top_cmd import add_top_args, run_top
        add_top_args(top)
        top.set_defaults(func=run_top)

    keys = sub.add_parser("keys", help="write CURVE key pairs (service beyond loopback)")
    if wants("keys"):
        from fmserve.keys_cmd import add_keys_args, run_keys
        add_keys_args(keys)
        keys.set_defaults(func=run_keys)

    worker = sub.add_parser("worker", help="a tensor-parallel rank on another machine "
                                           "(parallel.remote_ranks)")
    if wants("worker"):
        from fmserve.worker_cmd import add_worker_args, run_worker
        add_worker_args(worker)
        worker.set_defaults(func=run_worker)

    bench = sub.add_parser("bench", help="measure throughput")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    off = bench_sub.add_parser("offline", help="prefill and decode tokens/s vs transformers")
    add_runtime_args(off, dtype=None)
    off.add_argument("--batch-sizes", type=positive_int_list, default="1,8,32")
    off.add_argument("--dtypes", default="bf16,fp32")
    off.add_argument("--prompt-len", type=positive_int, default=128)
    off.add_argument("--decode-len", type=positive_int, default=64)
    off.add_argument("--no-baseline", action="store_true", help="skip transformers")
    ON_OFF = ["off", "on", "off,on"]  # "off,on": both, and their ratio
    off.add_argument("--overlap", default="off", choices=ON_OFF, metavar="off|on|off,on",
                     help="the engine's overlap (plan k+1 launched before step k finishes); "
                          "off,on measures both and prints their ratio")
    off.add_argument("--q4", default="on", choices=ON_OFF, metavar="off|on|off,on",
                     help="small forwards on the GGUF's own 4-bit weights (bf16 on a CPU; "
                          "runtime.q4_max_tokens); off,on measures both and prints their ratio")
    off.add_argument("--q4-max-tokens", type=int, default=12,  # DEFAULT_Q4_MAX_TOKENS
                     help="forwards of at most this many tokens use the 4-bit weights when "
                          "--q4 is on (also for --spec runs)")
    off.add_argument("--cuda-graphs", default="off", choices=ON_OFF, metavar="off|on|off,on",
                     help="decode batches replay CUDA graphs (runtime.cuda_graph_max_batch; "
                          "CUDA and --attention-backend triton only); off,on measures both "
                          "and prints their ratio")
    off.add_argument("--baseline-max-batch", type=int, default=32,
                     help="largest batch to run transformers at (it is slow)")
    off.add_argument("--markdown", default=None, help="also write the table to this file")
    if wants("bench", "offline"):
        from fmserve.bench.spec import add_bench_spec_args
        add_bench_spec_args(off)
        off.set_defaults(func=run_bench_offline_or_spec)
    srv = bench_sub.add_parser("serve", help="the service under load vs the offline engine")
    if wants("bench", "serve"):
        from fmserve.bench.serve import add_bench_serve_args, run_bench_serve
        add_bench_serve_args(srv)
        srv.set_defaults(func=run_bench_serve)
    http = bench_sub.add_parser("http", help="the same load over the OpenAI HTTP API and ZMQ")
    if wants("bench", "http"):
        from fmserve.bench.http import add_bench_http_args, run_bench_http
        add_bench_http_args(http)
        http.set_defaults(func=run_bench_http)
    peers = bench_sub.add_parser("peers", help="fmserve against transformers and llama.cpp: "
                                               "markdown report and plots")
    if wants("bench", "peers"):
        from fmserve.bench.peers import add_bench_peers_args, run_bench_peers
        add_bench_peers_args(peers)
        peers.set_defaults(func=run_bench_peers)
    prefix = bench_sub.add_parser("prefix", help="the prefix cache off and on: a shared system "
                                                 "prompt, and a multi-turn chat")
    if wants("bench", "prefix"):
        from fmserve.bench.prefix import add_bench_prefix_args, run_bench_prefix
        add_bench_prefix_args(prefix)
        prefix.set_defaults(func=run_bench_prefix)
    soak = bench_sub.add_parser("soak", help="minutes of streams with aborts, vanishing "
                                             "clients, malformed frames and worker kills")
    if wants("bench", "soak"):
        from fmserve.bench.soak import add_bench_soak_args, run_bench_soak
        add_bench_soak_args(soak)
        soak.set_defaults(func=run_bench_soak)

    from fmserve.train_eagle.cli import add_parser as add_train_eagle_parser
    add_train_eagle_parser(sub)  # its modules are light: torch comes with its run
    return parser


def run_bench_offline_or_spec(args: argparse.Namespace) -> int:
    """`bench offline --spec ...` measures speculative decoding (bench/spec.py)."""
    from fmserve.bench.offline import run_bench_offline
    from fmserve.bench.spec import run_bench_spec
    return run_bench_spec(args) if args.spec else run_bench_offline(args)


def check_draft_model_used(args: argparse.Namespace) -> None:
    """Refuse --draft-model where nothing would use it (it used to be ignored silently), before
    any model loads. `fmserve serve` checks it with its config (service/config.py) and
    `bench peers` against its selected peers (fmserve/bench/peers.py)."""
    draft = getattr(args, "draft_model", "")
    if not draft:
        return
    if args.command == "generate" and args.spec_algorithm == "none":
        raise ValueError(f"--draft-model {draft!r} is given but --spec-algorithm is none (the "
                         f"default), so speculative decoding is off and the draft model would "
                         f"be ignored: add --spec-algorithm eagle3 (or eagle) to use it, or "
                         f"drop --draft-model")
    if args.command == "bench" and args.bench_command == "offline" and not args.spec:
        raise ValueError(f"--draft-model {draft!r} is given without --spec, so the throughput "
                         f"sweep runs no speculative decoding and the draft model would be "
                         f"ignored: add --spec chain (or tree, or chain,tree) to measure it, or drop --draft-model")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:  # before torch loads: its kernels read their cap at import
        os.environ.update({k: v for k, v in torch_isa_env().items() if k not in os.environ})
    except ValueError as exc:
        print(f"fmserve: error: {exc}", file=sys.stderr)
        return 2
    args = build_parser(argv).parse_args(argv)  # imports the named command's modules
    from gpu.loader.errors import ModelLoadError
    from ipc.client_errors import ClientError
    args.argv = argv
    try:
        check_draft_model_used(args)
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    # Errors whose message is written for people: printed, no traceback. OSError: a file that
    # is missing, a directory or unreadable; ClientError: no service at the endpoint.
    except (ValueError, OSError, RuntimeError, ModelLoadError, ClientError) as exc:
        print(f"fmserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
