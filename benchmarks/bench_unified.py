"""Split pools against one unified memory for a hybrid model, in a simulated serving run (no model, no GPU).

Requests arrive with a prompt and an output length drawn from a mix and hold their KV (and, for a linear-attention
hybrid, one state slot) from admission to their last token.  Admission is first come, first served, each request
taking at once what it will hold at its end (pages of ``page_size`` tokens, whole).  Two mixes:

* ``chats``: many short requests (prompts 200-2000 tokens, outputs 50-500);
* ``documents``: few long ones (prompts 16k-64k, outputs 100-1000).

Two models, sized by kvcore's planner (``kvcore.plan_memory``) on an H200:

* Qwen3-Next-80B at tp 4 (hybrid Mamba): full-attention KV per token, one recurrent-state slot per request.  Split
  pools: the planner's token count and state slots (``mamba_full_memory_ratio`` 0.9: the states get 0.9 / 1.9 of
  the budget).
* gpt-oss-120b at tp 1 (hybrid sliding window): full layers keep every token, window layers the last 128 (a page
  more, as the window moves).  Split pools: the planner's full and window token counts
  (``swa_full_tokens_ratio`` 0.8).

The unified memory is the same budget as one byte range: full-attention pages (every full layer of a page) grow up
from one end, state slots or window pages (every such layer) down from the other, through
:class:`kvcore_unified.allocator.MultiEndedAllocator`.

Reported per model and mix: peak concurrent requests, peak tokens held, and the share of the budget in use the
first time the request at the head of the queue must wait (the target for the unified memory: at least 95%).

    python benchmarks/bench_unified.py [--requests 4000] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Callable

import kvcore
from kvcore_unified.allocator import HIGH, LOW, MultiEndedAllocator

PAGE = 16
WINDOW = 128
MIXES = {"chats": ((200, 2000), (50, 500)), "documents": ((16384, 65536), (100, 1000))}


def requests(mix: str, count: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    (p0, p1), (o0, o1) = MIXES[mix]
    return [(rng.randint(p0, p1), rng.randint(o0, o1)) for _ in range(count)]


class Pools:
    """What a request needs, and whether the pools hold it: ``take(needs) -> handle | None``, ``give(handle)``,
    ``used_bytes()``."""

    budget: int

    def take(self, needs: tuple[int, int]):
        raise NotImplementedError

    def give(self, handle) -> None:
        raise NotImplementedError

    def used_bytes(self) -> int:
        raise NotImplementedError


class Split(Pools):
    """Two pools of fixed sizes: ``units`` of ``bytes`` each (low and high kind)."""

    def __init__(self, budget: int, low: tuple[int, int], high: tuple[int, int]):
        self.budget, (self.low_units, self.low_bytes), (self.high_units, self.high_bytes) = budget, low, high
        self.low_used = self.high_used = 0

    def take(self, needs):
        low, high = needs
        if self.low_used + low > self.low_units or self.high_used + high > self.high_units:
            return None
        self.low_used += low
        self.high_used += high
        return needs

    def give(self, handle):
        self.low_used -= handle[0]
        self.high_used -= handle[1]

    def used_bytes(self):
        return self.low_used * self.low_bytes + self.high_used * self.high_bytes


class Unified(Pools):
    """The same budget as one byte range shared by both kinds (:class:`MultiEndedAllocator`)."""

    def __init__(self, budget: int, low_bytes: int, high_bytes: int):
        self.budget = budget
        self.a = MultiEndedAllocator(budget, low_bytes, high_bytes)

    def take(self, needs):
        low, high = needs
        if low * self.a.unit_bytes(LOW) + high * self.a.unit_bytes(HIGH) > self.a.free_bytes():
            return None
        return self.a.alloc(LOW, low), self.a.alloc(HIGH, high)

    def give(self, handle):
        self.a.free(LOW, handle[0])
        self.a.free(HIGH, handle[1])

    def used_bytes(self):
        return self.budget - self.a.free_bytes()


def serve(pools: Pools, reqs: list[tuple[int, int]], needs: Callable[[int, int], tuple[int, int]]) -> dict:
    """Run the requests through the pools, one decode step at a time; every step the queue's head is admitted
    while it fits.  Returns peak requests, peak tokens held, and the budget share in use at the first wait."""
    queue = list(reqs)
    running: list[tuple[int, object, int]] = []  # (finish step, handle, tokens)
    step = peak_requests = peak_tokens = 0
    first_wait = None
    while queue or running:
        done = [r for r in running if r[0] <= step]
        for r in done:
            pools.give(r[1])
        running = [r for r in running if r[0] > step]
        while queue:
            prompt, output = queue[0]
            handle = pools.take(needs(prompt, output))
            if handle is None:
                if first_wait is None and running:
                    first_wait = pools.used_bytes() / pools.budget
                break
            queue.pop(0)
            running.append((step + output, handle, prompt + output))
        peak_requests = max(peak_requests, len(running))
        peak_tokens = max(peak_tokens, sum(r[2] for r in running))
        if not running and queue:
            raise RuntimeError(f"a request of {queue[0]} tokens never fits these pools")
        step += 1
    return {"peak requests": peak_requests, "peak tokens": peak_tokens, "in use at first wait": first_wait}


def mamba_case():
    cfg = kvcore.load_config("model=qwen3-next-80b", "hardware=h200", "parallel.tp_size=4",
                             f"kv_cache.page_size={PAGE}")  # fmt: skip
    plan = kvcore.plan_memory(cfg)
    token_bytes = math.ceil(plan.layout.bytes_per_unit("tokens"))
    slot_bytes = math.ceil(plan.layout.bytes_per_unit("requests"))
    budget = plan.budget.kv_budget_bytes
    page_bytes = token_bytes * PAGE
    split = lambda: Split(budget, (plan.sizes["tokens"] // PAGE, page_bytes), (plan.sizes["requests"], slot_bytes))
    unified = lambda: Unified(budget, page_bytes, slot_bytes)
    needs = lambda p, o: (math.ceil((p + o) / PAGE), 1)
    what = (f"Qwen3-Next-80B tp 4: {token_bytes} B per token (full layers), {slot_bytes / 2**20:.2f} MiB per state "
            f"slot, budget {budget / 2**30:.1f} GiB; split: {plan.sizes['tokens']} tokens, {plan.sizes['requests']} slots")
    return what, split, unified, needs


def swa_case():
    cfg = kvcore.load_config("model=gpt-oss-120b", "hardware=h200", f"kv_cache.page_size={PAGE}")
    plan = kvcore.plan_memory(cfg)
    full_bytes = math.ceil(plan.layout.bytes_per_unit("tokens"))
    window_bytes = math.ceil(plan.layout.bytes_per_unit("swa_tokens"))
    budget = plan.budget.kv_budget_bytes
    split = lambda: Split(budget, (plan.sizes["tokens"] // PAGE, full_bytes * PAGE),
                          (plan.sizes["swa_tokens"] // PAGE, window_bytes * PAGE))  # fmt: skip
    unified = lambda: Unified(budget, full_bytes * PAGE, window_bytes * PAGE)
    window_pages = math.ceil(WINDOW / PAGE) + 1
    needs = lambda p, o: (math.ceil((p + o) / PAGE), min(math.ceil((p + o) / PAGE), window_pages))
    what = (f"gpt-oss-120b tp 1: {full_bytes} B per token (full layers), {window_bytes} B per window token, budget "
            f"{budget / 2**30:.1f} GiB; split: {plan.sizes['tokens']} full tokens, {plan.sizes['swa_tokens']} window")
    return what, split, unified, needs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"{'model, mix':<34} {'pools':<8} {'peak requests':>14} {'peak tokens':>12} {'in use at first wait':>21}")
    for case in (mamba_case, swa_case):
        what, split, unified, needs = case()
        print(what)
        for mix in MIXES:
            reqs = requests(mix, args.requests if mix == "chats" else args.requests // 10, args.seed)
            for name, make in (("split", split), ("unified", unified)):
                r = serve(make(), reqs, needs)
                share = "never waited" if r["in use at first wait"] is None else f"{r['in use at first wait']:.1%}"
                print(f"  {mix:<32} {name:<8} {r['peak requests']:>14} {r['peak tokens']:>12} {share:>21}", flush=True)


if __name__ == "__main__":
    main()
