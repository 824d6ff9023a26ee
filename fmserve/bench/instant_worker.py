"""A worker process that answers every plan at once, for `fmserve bench service-step`.

It speaks the real worker protocol (gpu/worker_main.py) over the same PAIR socket: WorkerReady
with the model's real capacity, then one StepResult per plan, in order, until Shutdown. It runs
no model: every row that samples gets the next token of a replayed stream (the dev prompts'
text, tokenized), so the service detokenizes ordinary words and no request meets its EOS. With
the worker's time near zero, the steps run as fast as the service can plan, meter and reply,
which is the regime of a fast GPU, where that side's time a step is the worker's idle.

    python -m fmserve.bench.instant_worker --endpoint E --config JSON --parent-pid P ...
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import zmq

from fmserve.bench import DEV_PROMPTS
from fmserve.jsonl import read_prompts
from gpu.loader.gguf_loader import gguf_model_config, open_gguf
from gpu.worker_main import parse_worker_config, watch_parent
from ipc.worker_messages import (WORKER_PROTOCOL_VERSION, Shutdown, StepPlan, StepResult,
                                 WorkerInfo, WorkerReady, pack_i32, unpack_i32)
from ipc.zmq_util import WorkerSideCodec, configure_socket
from service.tokenizer import TextTokenizer


def worker_info(config_json: str) -> WorkerInfo:
    """The capacity a real worker of this config announces (gpu/worker_state.py's info)."""
    cfg = parse_worker_config(config_json)
    path, rt, spec = Path(cfg.model.path), cfg.runtime, cfg.spec
    mc = gguf_model_config(open_gguf(path), path)
    return WorkerInfo(
        protocol_version=WORKER_PROTOCOL_VERSION, model_name=path.name, device="cpu",
        dtype="instant", attention_backend="none", num_layers=mc.num_layers,
        vocab_size=mc.vocab_size,
        max_context_len=min(rt.max_context_len or mc.max_context_len, mc.max_context_len),
        page_size=rt.page_size, num_pages=rt.max_kv_tokens // rt.page_size + 1,
        num_slots=rt.max_running_requests + 1, eos_token_ids=list(mc.eos_token_ids),
        spec_algorithm=spec.algorithm if spec.enabled else "none",
        spec_num_steps=spec.num_steps if spec.enabled else 0,
        spec_reserve_tokens=spec.reserve_tokens)


def token_stream(model_path: str, eos: list[int]) -> np.ndarray:
    """The dev prompts' text as the model's tokens, EOS taken out: what the rows emit."""
    tokenizer = TextTokenizer.from_model_path(model_path)
    ids = [t for text in read_prompts(str(DEV_PROMPTS))[:64] for t in tokenizer.encode(text)]
    return np.array([t for t in ids if t not in eos], dtype=np.int32)


def answer(sock: zmq.Socket, stream: np.ndarray, speculates: bool) -> int:
    """One StepResult per plan until Shutdown. `speculates`: a service with [spec] on, whose
    rows come as the EAGLE step's plain decodes (an accept length of -1: no verify), as a
    GPU's batches above the gate's limit do."""
    codec, at, finished = WorkerSideCodec(), 0, time.perf_counter()
    while True:
        msg = codec.decode(sock.recv())
        if isinstance(msg, Shutdown):
            return 0
        assert isinstance(msg, StepPlan), f"the instant worker takes plans, not {msg!r}"
        start = time.perf_counter()
        slots = [e.slot for e in msg.extends if e.sample] + unpack_i32(msg.decode_slots).tolist()
        tokens = np.take(stream, np.arange(at, at + len(slots)), mode="wrap")
        at = (at + len(slots)) % len(stream)
        end = time.perf_counter()
        sock.send(codec.encode(StepResult(
            step_id=msg.step_id, slots=pack_i32(slots), token_ids=pack_i32(tokens),
            logprobs=b"", top_logprobs_n=0, top_logprob_ids=b"", top_logprobs=b"",
            forward_ms=(end - start) * 1000.0, idle_ms=(start - finished) * 1000.0,
            accept_lens=pack_i32(np.full(len(slots), -1)) if speculates else b"")))
        finished = end


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fmserve.bench.instant_worker")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--cleanup-dir", default=None)
    args = parser.parse_args(argv)
    watch_parent(args.parent_pid, args.cleanup_dir)
    info, cfg = worker_info(args.config), parse_worker_config(args.config)
    stream = token_stream(cfg.model.path, info.eos_token_ids)
    ctx = zmq.Context()
    sock = configure_socket(ctx.socket(zmq.PAIR))
    try:
        sock.connect(args.endpoint)
        sock.send(WorkerSideCodec().encode(WorkerReady(info)))
        return answer(sock, stream, cfg.spec.enabled)
    finally:
        sock.close()
        ctx.term()


if __name__ == "__main__":
    sys.exit(main())
