"""What `fmserve bench peers` passes between its parts: the peer catalogue, the settings a
child process gets, and the measurement records the workers return and the report reads.

One module so that the runner (peers), its workers and its report import it and not each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Peer:
    key: str
    label: str
    group: str  # "hf", "llama-cpp", "llama-server", "offline:<spec>" or "served"
    only: str = ""  # "batch1": C = 1 only; "batched": C > 1 only
    overlap: bool = False
    spec: str = "off"  # off, chain, tree; prompt-lookup / assistant for transformers


def _fmserve_peers() -> list[Peer]:
    peers = []
    for mode in ("offline", "served"):
        for spec in ("off", "chain", "tree"):
            for overlap in (False, True):
                key = mode + ("-overlap" if overlap else "") + ("" if spec == "off" else f"-{spec}")
                label = (f"fmserve {mode}, overlap {'on' if overlap else 'off'}, "
                         f"{'no speculation' if spec == 'off' else 'EAGLE-3 ' + spec}")
                peers.append(Peer(key, label, f"offline:{spec}" if mode == "offline" else "served",
                                  overlap=overlap, spec=spec))
    return peers


PEERS: list[Peer] = [
    Peer("hf-b1", "transformers generate, batch 1 (baseline)", "hf", only="batch1"),
    Peer("hf-batched", "transformers generate, batched", "hf", only="batched"),
    Peer("hf-prompt-lookup", "transformers prompt-lookup decoding (assisted, no assistant)", "hf",
         only="batch1", spec="prompt-lookup"),
    Peer("hf-assisted", "transformers assisted generation (assistant model)", "hf",
         only="batch1", spec="assistant"),
    Peer("llama-cpp", "llama.cpp (llama-cpp-python)", "llama-cpp", only="batch1"),
    Peer("llama-server", "llama.cpp server, parallel slots (llama-server)", "llama-server"),
    *_fmserve_peers(),
]
BASELINE = "hf-b1"
# --quick leaves out the two served combinations of overlap and speculation (each is another
# service start); the offline engine runs all six, they share three model loads.
QUICK_LEAVES_OUT = ("served-overlap-chain", "served-overlap-tree")
LLAMA_INSTALL = "pip install llama-cpp-python"
NOT_APPLICABLE = {
    "hf-b1": "batch 1 only (batched: see transformers generate, batched)",
    "hf-batched": "at C = 1 this is the baseline",
    "hf-prompt-lookup": "transformers' assisted generation runs batch 1 only",
    "hf-assisted": "transformers' assisted generation runs batch 1 only",
    "llama-cpp": ("the Python API decodes one sequence at a time (see llama.cpp server, "
                  "parallel slots)"),
}

LLAMA_SERVER_INSTALL = (
    "build llama.cpp's server with scripts/build_llama_server.sh (from the llama.cpp source the "
    "llama-cpp-python sdist carries; a few minutes), then export the FMSERVE_LLAMA_SERVER it "
    "prints, or give --llama-server PATH")


@dataclass
class PeerConfig:
    """What a child process needs (picklable)."""
    model_path: str
    device: str
    dtype: str
    attention_backend: str
    threads: int
    max_new_tokens: int
    concurrency: list[int]
    max_kv_tokens: int
    max_context: int
    spec: dict[str, tuple]  # chain / tree -> SpecSettings fields
    prompt_lookup_tokens: int
    assistant_model: str
    llama_server: str = ""  # the binary, "" when there is none
    # --dtype as given: fmserve's peers take "auto" as such (on an AVX2-only CPU it keeps the
    # 4-bit codes, where an explicit fp32 is dense); `dtype` is what it resolves to
    fmserve_dtype: str = "auto"
    # 0: greedy; else every peer samples at this temperature, with these cuts (0, 1, 0: none)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def sampling_fields(self) -> dict:
        """fmserve's SamplingParams fields (and transformers' generate's) for the run."""
        if self.temperature > 0:
            return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                        min_p=self.min_p)
        return dict(temperature=0.0)


def llama_cpp_sampling(cfg: PeerConfig) -> dict:
    """llama.cpp's request fields for a peer run (llama-server and the Python API take the
    same): greedy, or the run's temperature and cuts, llama.cpp's own default cuts (top-k 40,
    top-p 0.95, min-p 0.05) replaced by the run's, so every peer cuts alike."""
    if cfg.temperature > 0:
        return cfg.sampling_fields()
    return dict(temperature=0.0, top_k=1)


@dataclass
class PeerResult:
    peer: Peer
    skipped: str = ""  # the reason, when the peer did not run at all
    points: dict[int, list[PointResult]] = field(default_factory=dict)  # C -> one per round
    point_skips: dict[int, str] = field(default_factory=dict)  # C -> why not measured


@dataclass
class Req:
    """One request as its client saw it. Times in seconds from when it was submitted."""
    ttft: float
    e2e: float
    tokens: int
    itl: list[float]  # one entry per token after the first chunk: a chunk of k tokens that came
    # g seconds after the previous one gives k entries g/k (speculation emits several at once)
    spec_steps: int = 0  # verify steps (speculative peers)
    spec_accepted: int = 0  # accepted draft tokens
    per_position: list[int] = field(default_factory=list)  # verify steps accepting depth i+1


@dataclass
class PointResult:
    """One peer at one concurrency: `requests` requests with at most `concurrency` in flight."""
    concurrency: int
    wall: float
    reqs: list[Req]
    peak_rss: int = 0  # bytes, the most the process (tree) running the peer held meanwhile
    gpu_peak: int = 0  # bytes, torch.cuda.max_memory_allocated (in-process peers on a GPU)


def req_from_stamps(stamps: list[float], sizes: list[int], e2e: float, **spec) -> Req:
    """A Req from chunk arrival times (seconds since submit) and chunk sizes."""
    itl: list[float] = []
    for prev, now, k in zip(stamps, stamps[1:], sizes[1:]):
        itl += [(now - prev) / k] * k
    return Req(stamps[0] if stamps else e2e, e2e, sum(sizes), itl, **spec)
