"""DP attention's steps through the worker process (parallel.dp_attention; gpu/dp_attention.py
is the model side): the service sends one GroupPlan per step, a StepPlan for each attention
rank. Rank 0 relays it to the other ranks as it relays every message (gpu/tp_ranks.py's
RelaySocket), every rank runs its own plan (an empty one is its idle batch: the ranks' MLP
collectives need every rank in every forward), the ranks' results are gathered to rank 0 over
the gloo group the plans travel on, and rank 0 answers one GroupResult.

No overlap here: rank 0 finishes a group step before it reads the next plan (the service's
group step loop sends one at a time, service/attention_group.py).
"""

from __future__ import annotations

import msgspec
import torch
import torch.distributed as dist

from gpu.worker_inbox import describe_exception, next_message
from ipc.worker_messages import GroupPlan, GroupResult, RankResult, Shutdown

_encode = msgspec.msgpack.Encoder().encode
_decode_rank = msgspec.msgpack.Decoder(RankResult).decode


def run_own_plan(ranks, worker, group: GroupPlan) -> RankResult:
    """This rank's plan of the group step, run to its result; with the idle forwards it ran."""
    if len(group.plans) != ranks.size:
        raise ValueError(f"group step {group.step_id} carries {len(group.plans)} plans for "
                         f"{ranks.size} attention ranks: the service and the worker disagree "
                         f"on parallel.tp")
    idle = worker.state.idle_counts
    steps, forwards = idle["step"], idle["target"] + idle["draft"]
    result = worker.run_step(group.plans[ranks.rank])
    return RankResult(result, idle["step"] - steps, idle["target"] + idle["draft"] - forwards)


def gather_to_rank0(ranks, payload: bytes) -> list[bytes] | None:
    """Every rank's bytes, in rank order, on rank 0 (None on the others): the lengths are
    all-gathered, then the buffers, padded to the longest, gathered (gloo has no gatherv)."""
    group = ranks.relay_group
    length = torch.tensor([len(payload)], dtype=torch.int64)
    lengths = [torch.empty_like(length) for _ in range(ranks.size)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n.item()) for n in lengths]
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    buf[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    parts = [torch.empty_like(buf) for _ in range(ranks.size)] if ranks.rank == 0 else None
    dist.gather(buf, parts, dst=0, group=group)
    if parts is None:
        return None
    return [p[:n].numpy().tobytes() for p, n in zip(parts, sizes)]


def follow_group_plan(ranks, worker, group: GroupPlan) -> None:
    """Ranks 1..N-1: run this rank's plan and hand its result to rank 0."""
    gather_to_rank0(ranks, _encode(run_own_plan(ranks, worker, group)))


def answer_group_plans(sock, codec, worker, ranks, fail) -> int | None:
    """Rank 0: answer every GroupPlan with a GroupResult until Shutdown (None) or a failure
    (`fail`'s exit code, after WorkerFailed). `sock` relays what it receives."""
    while True:
        msg, code = next_message(sock, codec, fail, (GroupPlan, Shutdown),
                                 "GroupPlan and Shutdown, with parallel.dp_attention")
        if code is not None:
            return code
        if isinstance(msg, Shutdown):
            return None
        try:
            mine = run_own_plan(ranks, worker, msg)
            theirs = gather_to_rank0(ranks, b"\0")  # rank 0's own result stays here
        except Exception as exc:
            return fail(msg.step_id, f"group step {msg.step_id} failed in the worker: "
                                     f"{describe_exception(exc)}", exc)
        results = [mine] + [_decode_rank(part) for part in theirs[1:]]
        sock.send(codec.encode(GroupResult(msg.step_id, results)))
