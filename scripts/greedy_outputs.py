"""Greedy token ids on dev prompts in four modes (plain, overlap, EAGLE-3 chain, EAGLE-3 tree),
for checking that a refactor leaves every output unchanged:

    python scripts/greedy_outputs.py before.json            # on the old commit
    python scripts/greedy_outputs.py after.json --compare before.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fmserve.bench import dev_texts
from fmserve.engine import Engine
from ipc.sampling import SamplingParams
from ipc.spec_settings import SpecSettings

MODES = {
    "plain": dict(overlap=False),
    "overlap": dict(overlap=True),
    "chain": dict(overlap=True, spec=SpecSettings("eagle3", num_steps=3, topk=1,
                                                  num_draft_tokens=4, disable_above_batch_size=0)),
    "tree": dict(overlap=False, spec=SpecSettings("eagle3", num_steps=3, topk=2,
                                                  num_draft_tokens=6, disable_above_batch_size=0)),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="JSON file the token ids are written to")
    parser.add_argument("--compare", type=Path, help="an earlier output: exit 1 if any differs")
    parser.add_argument("--prompts", type=int, default=12, help="first N dev prompts")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    args = parser.parse_args()
    chats = [[{"role": "user", "content": p}] for p in dev_texts()[:args.prompts]]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    out = {name: [c.token_ids for c in Engine(progress=False, **kw).generate(chats, params)]
           for name, kw in MODES.items()}
    args.out.write_text(json.dumps(out))
    if args.compare is None:
        return 0
    before = json.loads(args.compare.read_text())
    differ = [name for name in MODES if before.get(name) != out[name]]
    print("identical in every mode" if not differ else f"outputs differ in: {', '.join(differ)}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
