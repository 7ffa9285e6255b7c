"""The other process of tests/test_transfer.py: a decode-side KVTransferAgent in a process of its own.

    python tests/transfer_peer.py DIR NAME SEED [--exit] [config overrides...]

Builds the pools of ``kvcore.load_config(*overrides)``, fills every buffer with the random bytes of ``SEED``
(:func:`fill_random`, which the test repeats to know what the pool held), starts an agent ``NAME`` and writes its
metadata to ``DIR/NAME.md`` (whole, by a rename).  With ``--exit`` it then exits at once (a peer that went away).
Otherwise it waits for a notification starting with ``done`` from a writer (60 s at most, exit status 3 past
that), saves its buffers' bytes to ``DIR/NAME.pt`` (whole, by a rename) and exits 0.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch


def fill_random(pool, seed: int) -> None:
    """Random bytes of ``seed`` in every buffer of ``pool`` but nvfp4's per-layer global scales (which the two
    sides of a transfer must agree on)."""
    generator = torch.Generator().manual_seed(seed)
    for name, buf in pool.buffers().items():
        if name == "global_scale":
            continue
        raw = buf.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


def buffer_bytes(pool) -> dict[str, torch.Tensor]:
    """A copy of every buffer's bytes, by name."""
    return {name: buf.reshape(-1).view(torch.uint8).clone() for name, buf in pool.buffers().items()}


def main(argv: list[str]) -> int:
    import kvcore
    from kvcore.transfer import KVTransferAgent

    directory, name, seed, *rest = argv
    leave = "--exit" in rest
    overrides = [x for x in rest if x != "--exit"]
    pool = kvcore.build_pools(kvcore.load_config(*overrides)).token_to_kv_pool
    fill_random(pool, int(seed))
    agent = KVTransferAgent(name, pool)
    out = Path(directory)
    (out / f"{name}.md.tmp").write_bytes(agent.metadata())
    os.replace(out / f"{name}.md.tmp", out / f"{name}.md")
    if leave:
        return 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(m.startswith(b"done") for msgs in agent.notifications().values() for m in msgs):
            torch.save(buffer_bytes(pool), out / f"{name}.pt.tmp")
            os.replace(out / f"{name}.pt.tmp", out / f"{name}.pt")
            agent.close()
            return 0
        time.sleep(0.01)
    return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
