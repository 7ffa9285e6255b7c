"""transformers generation on kvcore's PagedKVCache beside DynamicCache (issue 31): tokens per second of each, side by
side in one process, for batch 1 and 8, prompts of 100 and 4000 tokens, bf16 and fp8 caches.

A random-weight Llama of Llama-3-8B's attention shape (8 layers, hidden 4096, 32 heads, 8 KV heads of 128), bf16,
``attn_implementation`` eager (``--attn sdpa`` for SDPA), greedy.  Per case, in this order:

1. **Logit identity**: one prefill and two decode steps through each cache, and through DynamicCache again; their
   logits are compared bit for bit.  A bf16 cache is compared with DynamicCache, an fp8 cache with a DynamicCache
   whose keys and values are rounded through fp8 the same way (what the fp8 cache stores); ``dynamic2`` with
   DynamicCache in every case.  ``dyn==dyn`` says whether DynamicCache gave its own logits again (on a GPU it need
   not: a difference there is the GPU's, not the cache's).
2. **Host time per layer and decode step**: ``cache.update`` alone, every layer, over ``--steps`` decode steps
   after the prompt, no synchronization inside (launches are asynchronous, so this is the host's time; when the
   device falls behind, it is the device's).  Layers 1..L-1 (``us/layer``) apart from layer 0 (which also gives
   the rows their slots).  Twice: the updates back to back (``alone``: the cache's code and data stay in the CPU's
   caches), and each update timed by itself after one of the model's MLPs has run (``amid MLPs``: what runs between
   two layers' updates in a real step passes through the CPU's caches first).
3. **Tokens per second**: ``model.generate`` of ``--new`` tokens after a warm-up run, the caches interleaved over
   ``--rounds`` rounds, every other round in reverse order (the host's noisy stretches last seconds: interleaving
   spreads them over all caches; reversing keeps any one from always running first); the
   best round of each, and per cache the median over rounds of its speed over DynamicCache's *in the same round*
   (``paired``: what drifts from round to round cancels), with a 90% bootstrap interval of that median (the rounds
   resampled): a case whose interval holds 1.0 is at parity within the host's noise, not faster or slower.  Each
   generate's decode steps are also timed one by one (a logits processor notes each step's start) and the same
   paired median is taken of the rounds' median step (``paired step``: a stall of the host inside a round moves a
   round's total, hardly its median step).  No garbage collection runs inside a timed generate;
   ``--pin-cpu`` keeps the process on one core (every thread of it, CUDA's and torch's own too; on the H200 it did
   not narrow the rounds' spread, 2026-12-03).
4. **Lockstep**: one ``model.generate`` per cache, all running at once in threads that take turns a decode step
   each (a logits processor waits for the device, notes the time, hands the turn to the next generate and waits
   for its own).  A cache's step runs from its turn's start to its next note, so no cache's time holds another's,
   and the host's slow stretches (seconds long on the H200, 8 against 14 ms a step) fall on neighbouring steps of
   every cache alike; the threads share one core, so none runs on a busier or colder one.  Per cache: tokens/s
   over its own steps (the prefill excluded), and DynamicCache's time over its own in blocks of 16 consecutive
   steps, the median of those ratios with a 90% bootstrap interval (the blocks resampled), over ``--lockstep``
   runs.

Caches: ``dynamic`` (DynamicCache), ``kvcore`` (PagedKVCache as built: pages of 16 allocated as the rows grow,
keys and values gathered for attention in one launch a layer) and ``contig`` (``contiguous_rows=True``: one
reserved run per row, attention reads strided views of the pool when the cache keeps the model's dtype);
``dynamic_b`` is DynamicCache again (the method's control: its ratio to ``dynamic`` is 1 but for the noise);
``dynamic2`` and ``kvcore2`` do their cache's work twice (every update also goes to a second cache of the same kind),
so that, run in lockstep beside the plain ones, each one's step time less its plain cache's is what that cache's own
work costs inside a real step; ``kvplain`` is kvcore's cache without the host savings of 2026-12-03 (a new output
pair per layer, every launch planned in full: :class:`PlainPagedKVCache`); ``contigcopy`` is ``contig`` whose decode
steps store with ``copy_`` into the pool's views instead of the pool's store (no Triton launch in a decode step:
:class:`ContigCopyPagedKVCache`, a trial); ``kvbare`` is kvcore's cache whose later layers of a forward launch with no
per-layer check (a bound on what trimming the fast path's Python could save: :class:`BarePagedKVCache`);
``kvresident`` is kvcore's cache with ``resident_rows=True`` (every layer's gathered rows kept between steps, a step
writing only its new tokens into them).  ``null`` is not a cache but a bound (:class:`NullLayer`: an update stores
nothing and returns two contiguous views of the shapes DynamicCache's would have, their values stale; its logits are
not checked): the most any cache could gain over DynamicCache in a step by its update costing nothing.  Three more
bounds split a cache's cost inside a step into its work and what it hands attention: ``nulldyn`` and ``nullkv`` hand
attention ``null``'s outputs but do DynamicCache's or kvcore's whole update on a second cache first (its outputs
dropped), and ``kvnolaunch`` is kvcore's cache whose store-and-gather launches are no-ops once planned
(``probe_hf_parts.NoLaunchPagedKVCache``: its Python without its launches).

    python benchmarks/bench_hf_generate.py                    # on the GPU; results also in $OUT/hf_generate.json
    python benchmarks/bench_hf_generate.py --device cpu --small   # a quick smoke run on the CPU
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import platform
import statistics
import threading
import time

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import Cache, DynamicLayer
from transformers.models.llama.modeling_llama import LlamaModel

from kvcore.integrations.transformers import PagedKVCache
from kvcore.kernels.head_gather import HeadGather

FP8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}

#: caches that are bounds, not caches: their logits are not checked
BOUNDS = ("null", "nulldyn", "nullkv", "kvnolaunch")

#: the keyword a forward and generate take a cache by: ``cache`` since transformers renamed ``past_key_values``
CACHE_KW = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


class StepClock(LogitsProcessor):
    """Notes the time of every decode step of a generate (a logits processor runs once a new token; generate's
    stopping check waits for the device each step, so the gaps between its calls are whole steps)."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores

    def median_step(self) -> float:
        """The median gap between steps, seconds (the prefill excluded: it ends at the first stamp)."""
        return statistics.median(b - a for a, b in zip(self.stamps, self.stamps[1:]))


class Turns:
    """Decode steps of several generates, one at a time in a fixed order: generate ``i`` runs while the others
    wait in :meth:`hand_on`; a generate that has made its last step leaves the ring."""

    def __init__(self, count: int, timeout: float = 600.0):
        self.turn, self.live, self.timeout = 0, list(range(count)), timeout
        self.cond = threading.Condition()
        self.failed: BaseException | None = None

    def wait_for(self, who: int) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.turn == who or self.failed is not None, self.timeout):
                raise TimeoutError(f"generate {who} waited {self.timeout} s for its turn")
            if self.failed is not None:
                raise RuntimeError("another generate of the lockstep run failed") from self.failed

    def hand_on(self, who: int, last: bool) -> None:
        """``who`` has made a step: the next live generate's turn; ``who`` waits for its own unless ``last``."""
        with self.cond:
            at = self.live.index(who)
            if last:
                self.live.remove(who)
            if self.live:
                self.turn = self.live[(at if last else at + 1) % len(self.live)]
            self.cond.notify_all()
        if not last:
            self.wait_for(who)

    def fail(self, error: BaseException) -> None:
        with self.cond:
            self.failed = error
            self.cond.notify_all()


class TurnClock(LogitsProcessor):
    """A generate's share of a lockstep run: after each step it waits for the device, notes the time, hands the turn
    on and notes when it gets it back; its ``i``-th decode step ran from ``resumed[i - 1]`` to ``stamps[i]``."""

    def __init__(self, turns: Turns, who: int, tokens: int, device: str):
        self.turns, self.who, self.tokens, self.device = turns, who, tokens, device
        self.stamps: list[float] = []
        self.resumed: list[float] = []

    def __call__(self, input_ids, scores):
        sync(self.device)
        self.stamps.append(time.perf_counter())
        self.turns.hand_on(self.who, last=len(self.stamps) == self.tokens)
        self.resumed.append(time.perf_counter())
        return scores

    def steps(self) -> list[float]:
        """Seconds of each decode step (the prefill excluded; the last step too, whose end overlaps the others')."""
        return [end - start for start, end in zip(self.resumed[:-2], self.stamps[1:-1])]


def lockstep(model, caches: dict, ids, mask, tokens: int, device: str, clock_cls=TurnClock) -> dict[str, list[float]]:
    """One generate of ``tokens`` per cache of ``caches`` (name -> cache), in turns (:class:`Turns`): each one's
    decode step times, seconds.  ``clock_cls(turns, who, tokens, device)`` makes each generate's
    :class:`TurnClock`."""
    turns = Turns(len(caches))
    clocks = {name: clock_cls(turns, who, tokens, device) for who, name in enumerate(caches)}

    core = sorted(os.sched_getaffinity(0))[-1] if hasattr(os, "sched_getaffinity") else None

    def generate(name: str, cache) -> None:
        clock = clocks[name]
        try:
            if core is not None:  # every generate's thread on the same core: none runs on a busier or colder one
                os.sched_setaffinity(0, {core})
            turns.wait_for(clock.who)
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                               do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]),
                               **{CACHE_KW: cache})  # fmt: skip
        except BaseException as error:  # the others stop waiting for this one's turn
            turns.fail(error)
            raise

    threads = [threading.Thread(target=generate, args=item, name=f"lockstep-{item[0]}") for item in caches.items()]
    gc.collect()
    sync(device)
    gc.disable()
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        gc.enable()
    if turns.failed is not None:
        raise RuntimeError("a lockstep generate failed") from turns.failed
    return {name: clock.steps() for name, clock in clocks.items()}


def block_ratios(base: list[float], other: list[float], block: int = 16) -> list[float]:
    """``sum(base) / sum(other)`` over each run of ``block`` consecutive steps (a partial last run dropped; runs of
    a quarter of the steps when there are fewer than ``4 * block``)."""
    block = max(1, min(block, len(base) // 4))
    return [sum(base[i : i + block]) / sum(other[i : i + block]) for i in range(0, len(base) - block + 1, block)]


class _Shadowed:
    """A cache mixin: every update goes to ``self.shadow`` (another cache; its outputs dropped) before the cache's
    own, one call level deep."""

    shadow: Cache

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.shadow.update(key_states, value_states, layer_idx, *args, **kwargs)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class ShadowedDynamicCache(_Shadowed, DynamicCache):
    """DynamicCache doing its work twice: every update also goes to a second DynamicCache (``dynamic2``).  Its
    step time less DynamicCache's is what DynamicCache's own work costs inside a real step (host and device)."""

    def __init__(self, config):
        super().__init__(config=config)
        self.shadow = DynamicCache(config=config)


class ShadowedPagedKVCache(_Shadowed, PagedKVCache):
    """:class:`ShadowedDynamicCache` for kvcore (``kvcore2``): every update also goes to a second PagedKVCache."""

    shadow: PagedKVCache


class PlainPagedKVCache(PagedKVCache):
    """kvcore's cache as it was before 2026-12-03's host savings (``kvplain``), to time beside the cache as built: every
    layer's update through ``_update``, every forward's set-up worked out in full with a view of the table's rows, a
    new output pair per call (``reuse_outputs=False``) and every ``store_and_gather`` planned in full
    (:class:`_PlainHeadGather` keeps no last launch)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self._update(self.layers[layer_idx], key_states, value_states)

    def _begin_step(self, key_states, value_states, end):
        step = super()._begin_step(key_states, value_states, end)
        if step.length is not None:  # a view of the table a step (no length: every forward planned again)
            step.read_locs, step.length = step.read_locs[:, :end], None
        return step

    def _gather_for(self, dtype: torch.dtype):
        gather = super()._gather_for(dtype)
        if type(gather) is not _PlainHeadGather:
            gather.__class__ = _PlainHeadGather
            gather._reuse = False
        return gather


class ContigCopyPagedKVCache(PagedKVCache):
    """``contiguous_rows`` whose decode steps store by ``copy_`` into the pool's strided views of the reserved runs
    (``contigcopy``): every layer's update two torch views, two ``copy_`` and no Triton launch, a trial of a launch-free
    decode path (bf16 in the model's dtype only; anything else goes the cache's own way)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        if key_states.shape[-2] != 1 or not layer.is_initialized:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        end, step = layer.seq_len + 1, self._step
        if step is None or step.end != end or step.q != 1:
            step = self._begin_step(key_states, value_states, end)
        if step.view_shape is None or step.live is not None:
            return self._update(layer, key_states, value_states)
        k_buf, k_dim, k_stride, k_offset, v_buf, v_dim, v_stride, v_offset = self._row_views[layer.layer_id]
        batch, heads = step.view_shape[:2]
        k_buf.as_strided((batch, heads, 1, k_dim), k_stride, k_offset + (end - 1) * k_stride[2]).copy_(key_states)
        v_buf.as_strided((batch, heads, 1, v_dim), v_stride, v_offset + (end - 1) * v_stride[2]).copy_(value_states)
        layer.seq_len = end
        return (k_buf.as_strided((*step.view_shape, k_dim), k_stride, k_offset),
                v_buf.as_strided((*step.view_shape, v_dim), v_stride, v_offset))  # fmt: skip


class BarePagedKVCache(PagedKVCache):
    """kvcore's cache whose later layers of a forward launch the first layer's store-and-gather again with no check
    and no output bookkeeping (``kvbare``, a bound, not a cache to use): the launch's arguments but the layer's and
    the new rows' addresses come from the first layer's, and the spare output pair is handed out as it is.  What
    trimming the fast path's per-layer Python could save at most inside a real step; correct only as ``generate``
    calls it (each layer's keys and values dropped before the next layer's update)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        step = self._step
        if layer_idx and step is not None and step.fused:
            gather = step.gather
            last, spare = gather._last_launch, gather._spare
            # (the first layer's launch of this forward, onto the spare pair: a first call planned through Triton's
            # dispatcher leaves an older forward's last launch, or one _last_at_length moved to this length)
            if (last is not None and spare is not None and last[6] == spare[2] == (len(self._slots), step.end)
                    and last[7][2] == step.q):  # fmt: skip
                kp, vp = gather._addresses[layer_idx]
                last[11](*last[12], last[13](last[14]), *last[15], kp, vp, spare[10], spare[11], last[2],
                         key_states.data_ptr(), value_states.data_ptr(), *last[16])  # fmt: skip
                self.layers[layer_idx].seq_len = step.end
                return spare[0], spare[1]
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class _PlainHeadGather(HeadGather):
    """A HeadGather that never repeats its last launch (its memo reads as empty and ignores writes)."""

    @property
    def _last_launch(self):
        return None

    @_last_launch.setter
    def _last_launch(self, value):
        pass


class NullLayer(DynamicLayer):
    """A layer of the ``null`` bound, not a cache: an update stores nothing and returns two contiguous tensors of the
    shapes DynamicCache's would have (``[batch, heads, tokens so far, dim]``, views of one buffer each allocated at
    the first update, their values stale): what a step gives when the cache's update costs nothing but two views and
    hands attention what DynamicCache hands it (contiguous rows; strided views of a bigger buffer cost attention more,
    the twenty-second session's ``contigcopy``)."""

    def __init__(self, room: int):
        super().__init__()
        self.room, self.end = room, 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.shape = key_states.shape[:2]
        self.dims = key_states.shape[-1], value_states.shape[-1]
        self.keys = key_states.new_empty(self.shape.numel() * self.room * self.dims[0])
        self.values = value_states.new_empty(self.shape.numel() * self.room * self.dims[1])
        self.device, self.end, self.is_initialized = key_states.device, 0, True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.end = self.end + key_states.shape[-2]
        (batch, heads), (dk, dv) = self.shape, self.dims
        return (self.keys.as_strided((batch, heads, end, dk), (heads * end * dk, end * dk, dk, 1)),
                self.values.as_strided((batch, heads, end, dv), (heads * end * dv, end * dv, dv, 1)))

    def get_seq_length(self) -> int:
        return self.end if self.is_initialized else 0


class ShadowedNullCache(_Shadowed, Cache):
    """The ``null`` bound doing another cache's whole update first (``nulldyn``, ``nullkv``): ``shadow`` gets every
    update and its outputs are dropped; attention gets ``null``'s."""

    def __init__(self, layers: list, shadow):
        super().__init__(layers=layers)
        self.shadow = shadow


class RoundedLayer(DynamicLayer):
    """A DynamicLayer holding its keys/values rounded through an fp8 dtype: what an fp8 PagedKVCache stores."""

    def __init__(self, fp8: torch.dtype):
        super().__init__()
        self.fp8 = fp8

    def update(self, key_states, value_states, *args, **kwargs):
        return super().update(key_states.to(self.fp8).to(key_states.dtype),
                              value_states.to(self.fp8).to(value_states.dtype))  # fmt: skip


def build_model(args):
    if args.small:
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)  # fmt: skip
    else:
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=8192, num_hidden_layers=8, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=32000, max_position_embeddings=8192)  # fmt: skip
    cfg._attn_implementation = args.attn
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(args.device, torch.bfloat16).eval()


def probe_case(model, case: str, device: str) -> tuple[str, int, int, torch.Tensor, torch.Tensor]:
    """A probe's case ``"dtype:batch:prompt"``: ``(dtype, batch, prompt, ids, mask)``, the prompt ids random (seed 0)
    and unpadded."""
    dtype, batch, prompt = case.split(":")
    batch, prompt = int(batch), int(prompt)
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    return dtype, batch, prompt, ids, torch.ones_like(ids)


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a tiny model, short prompts, few tokens (a smoke run)")
    parser.add_argument("--attn", default="eager", help="the model's attn_implementation (eager, sdpa)")
    parser.add_argument("--new", type=int, default=None, help="new tokens per generate (256; --small: 16)")
    parser.add_argument("--rounds", type=int, default=None, help="timed generate rounds per cache (3; --small: 1)")
    parser.add_argument("--steps", type=int, default=None, help="decode steps of the host-time loop (64; --small: 16)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtypes", default="bfloat16,float8_e4m3fn")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompts", default=None, help="prompt lengths (100,4000; --small: 20,200)")
    parser.add_argument("--caches", default="dynamic,kvcore,contig", help="caches timed (dynamic always is): "
                        "dynamic, dynamic_b, kvcore, contig, dynamic2, kvcore2, kvplain, contigcopy, kvbare, kvresident; "
                        "bounds: null, nulldyn, nullkv, kvnolaunch")
    parser.add_argument("--lockstep", type=int, default=None, help="lockstep runs per case (2; --small: 1; 0: none)")
    parser.add_argument("--pin-cpu", action="store_true", help="run on one CPU core (less host noise between rounds)")
    args = parser.parse_args()
    new = args.new or (16 if args.small else 256)
    rounds = args.rounds or (1 if args.small else 3)
    steps = args.steps or (16 if args.small else 64)
    lockstep_runs = args.lockstep if args.lockstep is not None else (1 if args.small else 2)
    prompts = [int(p) for p in (args.prompts or ("20,200" if args.small else "100,4000")).split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    device = args.device
    if args.pin_cpu and hasattr(os, "sched_setaffinity"):  # the host's Python thread on one core: no migrations
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    if args.small:
        torch.set_num_threads(1)  # tiny ops: one thread is the least noisy
    model = build_model(args)
    cfg = model.config
    vocab = cfg.vocab_size
    where = torch.cuda.get_device_name() if torch.device(device).type == "cuda" else platform.processor() or "cpu"
    print(f"{where}; torch {torch.__version__}, transformers {transformers.__version__}; Llama {cfg.num_hidden_layers} "
          f"layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads, {cfg.num_key_value_heads} KV heads, "
          f"bf16, {args.attn}; {new} new tokens, best of {rounds} rounds; page {args.page_size}",
          flush=True)  # fmt: skip
    caches = ["dynamic"] + [c for c in args.caches.split(",") if c != "dynamic"]
    others = caches[1:]
    results = []
    header = (f"{'dtype':<10} {'batch':>5} {'prompt':>6}  {'logits':<14}  host us/layer (layer 0), alone | amid MLPs: "
              + " ".join(f"{name:>27}" for name in caches) + "  tok/s (best): "
              + " ".join(f"{name:>16}" for name in caches) + "  paired median [90%]: " + " ".join(f"{n:>22}" for n in others)
              + "  paired step median [90%]: " + " ".join(f"{n:>22}" for n in others)
              + "  lockstep tok/s: " + " ".join(f"{name:>16}" for name in caches)
              + "  lockstep ratio [90%]: " + " ".join(f"{n:>22}" for n in others))
    print(header)
    print("-" * len(header))
    for dtype in args.dtypes.split(","):
        for batch in batches:
            for prompt in prompts:
                row = run_case(model, args, device, dtype, batch, prompt, new, rounds, steps, vocab, caches,
                               lockstep_runs)
                results.append(row)
                t, paired, us, band = row["tok_s"], row["paired_ratio"], row["host_us"], row["paired_interval"]
                step, step_band = row["paired_step_ratio"], row["paired_step_interval"]
                differ = [name for name, same in row["identical_by_cache"].items() if not same]
                logits = ("same" if not differ else "DIFFER: " + ",".join(differ)) + \
                    ("" if row["dynamic_repeatable"] else " (dyn!=dyn)")
                amid = row["host_us_amid"]
                host = " ".join(f"{us[n][1]:5.1f} ({us[n][0]:5.1f}) {amid[n][1]:5.1f} ({amid[n][0]:5.1f})" for n in caches)
                speed = " ".join(f"{t[n]:7.1f}" + (f" ({t[n] / t['dynamic']:4.2f}x)" if n != "dynamic" else " " * 8)
                                 for n in caches)  # fmt: skip
                print(f"{dtype.replace('float8_', 'fp8 '):<10} {batch:>5} {prompt:>6}  {logits:<14}  "
                      f"{'':>44}{host}  {'':>14}{speed}  {'':>21}"
                      + " ".join(f"{paired[n]:6.3f}x [{band[n][0]:.3f}, {band[n][1]:.3f}]" for n in others)
                      + f"  {'':>26}" + " ".join(f"{step[n]:6.3f}x [{step_band[n][0]:.3f}, {step_band[n][1]:.3f}]"
                                                 for n in others)
                      + lockstep_columns(row, caches), flush=True)  # fmt: skip
    out = os.path.join(os.environ.get("OUT", "/tmp"), "hf_generate.json")
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"results in {out}")


def case_inputs(batch: int, prompt: int, vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    """A case's prompt ``(ids, mask, generator)``: random ids (seeded by the case), row 0 a third shorter (left
    padding) when the batch has more than one row, as ``generate`` gets a padded batch; the generator goes on for
    the case's other random inputs."""
    gen = torch.Generator().manual_seed(batch * 10007 + prompt)
    ids = torch.randint(1, vocab, (batch, prompt), generator=gen).to(device)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[0, : prompt // 3] = 0
    return ids, mask, gen


def three_steps(model, ids: torch.Tensor, mask: torch.Tensor, cache) -> list[torch.Tensor]:
    """The logit check's logits through ``cache``: a prefill of ``ids``, then two greedy decode steps."""
    with torch.no_grad():
        logits = [model(input_ids=ids, attention_mask=mask, **{CACHE_KW: cache}).logits]
        step_mask = mask
        for _ in range(2):
            nxt = logits[-1][:, -1:].argmax(-1)
            step_mask = torch.cat([step_mask, torch.ones_like(nxt)], 1)
            logits.append(model(input_ids=nxt, attention_mask=step_mask, **{CACHE_KW: cache}).logits)
    return logits


def reference_cache(model, dtype: str):
    """What a cache of ``dtype`` must match bit for bit: DynamicCache, or for fp8 one whose every key and value is
    rounded through fp8 once (what the fp8 cache stores)."""
    if dtype in FP8:
        return Cache(layers=[RoundedLayer(FP8[dtype]) for _ in range(model.config.num_hidden_layers)])
    return DynamicCache(config=model.config)


def run_case(model, args, device, dtype, batch, prompt, new, rounds, steps, vocab, caches, lockstep_runs) -> dict:
    ids, mask, gen = case_inputs(batch, prompt, vocab, device)
    layers = model.config.num_hidden_layers
    room = prompt + max(new, steps) + 64  # tokens a row reaches, with a margin
    capacity = batch * room

    def paged(contiguous_rows: bool = False, cls=PagedKVCache, resident_rows: bool = False):
        return cls.from_model(model, max_total_tokens=capacity, page_size=args.page_size, dtype=dtype,
                              max_batch_size=batch, contiguous_rows=contiguous_rows, resident_rows=resident_rows)  # fmt: skip

    def dynamic():
        return DynamicCache(config=model.config)

    def null_layers():
        return [NullLayer(room) for _ in range(layers)]

    def no_launch():
        from probe_hf_parts import NoLaunchPagedKVCache  # (it imports this module)

        return paged(cls=NoLaunchPagedKVCache)

    def shadowed_paged():
        cache = paged(cls=ShadowedPagedKVCache)
        cache.shadow = paged()
        return cache

    makers = {"dynamic": dynamic, "dynamic_b": dynamic, "kvcore": paged, "contig": lambda: paged(True),
              "dynamic2": lambda: ShadowedDynamicCache(model.config), "kvcore2": shadowed_paged,
              "kvplain": lambda: paged(cls=PlainPagedKVCache),
              "contigcopy": lambda: paged(True, cls=ContigCopyPagedKVCache),
              "kvbare": lambda: paged(cls=BarePagedKVCache), "kvresident": lambda: paged(resident_rows=True),
              "null": lambda: Cache(layers=null_layers()), "kvnolaunch": no_launch,
              "nulldyn": lambda: ShadowedNullCache(null_layers(), dynamic()),
              "nullkv": lambda: ShadowedNullCache(null_layers(), paged())}  # fmt: skip
    makers = {name: makers[name] for name in caches}

    # 1. logit identity: a prefill and two decode steps
    want = three_steps(model, ids, mask, reference_cache(model, dtype))
    repeatable = all(map(torch.equal, three_steps(model, ids, mask, reference_cache(model, dtype)), want))
    plain = three_steps(model, ids, mask, dynamic()) if dtype in FP8 else want  # what DynamicCache's kind must give
    identical = {name: all(map(torch.equal, three_steps(model, ids, mask, make()),
                               plain if name.startswith("dynamic") else want))
                 for name, make in makers.items() if name != "dynamic" and name not in BOUNDS}  # fmt: skip

    # 2. host time per layer and decode step, cache.update alone
    heads, dim = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    kv = torch.randn(2, batch, heads, prompt + 1, dim, generator=gen).to(device, torch.bfloat16)
    prompt_kv, step_kv = (kv[0, :, :, :prompt], kv[1, :, :, :prompt]), (kv[0, :, :, prompt:], kv[1, :, :, prompt:])

    mlp = model.model.layers[0].mlp
    hidden = torch.randn(batch, 1, model.config.hidden_size, generator=gen).to(device, torch.bfloat16)

    def host_us(make, amid: bool = False):
        """(layer 0's, the other layers' mean) host µs of ``cache.update`` in a decode step; ``amid``: each update
        timed alone, after one of the model's MLPs has run (what a real step runs between two layers' updates)."""
        cache = make()
        with torch.no_grad():
            for layer in range(layers):
                cache.update(*prompt_kv, layer)
            for layer in range(layers):  # one step unmeasured: every plan made
                cache.update(*step_kv, layer)
            sync(device)
            clock = time.perf_counter_ns
            first = rest = 0
            for _ in range(steps):
                if amid:
                    for layer in range(layers):
                        mlp(hidden)
                        start = clock()
                        cache.update(*step_kv, layer)
                        took = clock() - start
                        first, rest = (first + took, rest) if layer == 0 else (first, rest + took)
                    continue
                start = clock()
                cache.update(*step_kv, 0)
                middle = clock()
                for layer in range(1, layers):
                    cache.update(*step_kv, layer)
                first, rest = first + middle - start, rest + clock() - middle
            sync(device)
        return first / steps / 1e3, rest / steps / (layers - 1) / 1e3

    host, host_amid = ({name: min((host_us(make, amid) for _ in range(3)), key=lambda t: t[1])
                        for name, make in makers.items()} for amid in (False, True))  # fmt: skip

    # 3. generate: tokens per second
    def run(cache, tokens) -> tuple[float, float]:
        """(seconds of the generate, its median decode step's seconds)."""
        clock = StepClock()
        gc.collect()  # the caches of earlier runs (cycles: a cache and its layers) gone before the clock starts
        sync(device)
        gc.disable()  # no collection inside the timed run (it lands on one cache or the other)
        try:
            start = time.perf_counter()
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                               do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]),
                               **{CACHE_KW: cache})  # fmt: skip
            sync(device)
            return time.perf_counter() - start, clock.median_step()
        finally:
            gc.enable()

    for make in makers.values():
        run(make(), 4)  # warm-up: every kernel compiled, every plan made
    times = {name: [] for name in makers}
    steps_s = {name: [] for name in makers}
    order = list(makers.items())
    for r in range(rounds):  # each round in the other order from the last: no cache always runs first
        for name, make in order if r % 2 == 0 else order[::-1]:
            seconds, step = run(make(), new)
            times[name].append(seconds)
            steps_s[name].append(step)
    step_ratios = {name: [d / c for d, c in zip(steps_s["dynamic"], t)] for name, t in steps_s.items()}

    # 4. lockstep: every cache's generate at once, a decode step each in turn
    own = {name: [] for name in makers}
    blocks = {name: [] for name in makers}
    for r in range(lockstep_runs):
        ring = list(makers) if r % 2 == 0 else list(makers)[::-1]  # no cache always steps first
        took = lockstep(model, {name: makers[name]() for name in ring}, ids, mask, new, device)
        for name in makers:
            own[name] += took[name]
            blocks[name] += block_ratios(took["dynamic"], took[name])
    return dict(
        lockstep_tok_s={name: batch * len(t) / sum(t) for name, t in own.items() if t},
        lockstep_ratio={name: statistics.median(b) for name, b in blocks.items() if b},
        lockstep_interval={name: median_interval(b) for name, b in blocks.items() if b},
        lockstep_step_ms={name: [1e3 * s for s in t] for name, t in own.items()},
        median_step_ms={name: [1e3 * s for s in t] for name, t in steps_s.items()},
        paired_step_ratio={name: statistics.median(r) for name, r in step_ratios.items()},
        paired_step_interval={name: median_interval(r) for name, r in step_ratios.items()},
        dtype=dtype, batch=batch, prompt=prompt, new_tokens=new, attn=args.attn,
        tok_s={name: batch * new / min(t) for name, t in times.items()},
        median_tok_s={name: batch * new / statistics.median(t) for name, t in times.items()},
        paired_ratio={name: statistics.median(d / c for d, c in zip(times["dynamic"], t)) for name, t in times.items()},
        paired_interval={name: median_interval([d / c for d, c in zip(times["dynamic"], t)]) for name, t in times.items()},
        seconds=times,
        host_us=host, host_us_amid=host_amid, identical=all(identical.values()), identical_by_cache=identical,
        dynamic_repeatable=repeatable,
    )  # fmt: skip


def lockstep_columns(row: dict, caches: list[str]) -> str:
    """The lockstep columns of a case's line (blank without lockstep runs)."""
    tok_s, ratio, band = row["lockstep_tok_s"], row["lockstep_ratio"], row["lockstep_interval"]
    if not tok_s:
        return ""
    speed = " ".join(f"{tok_s[n]:7.1f}" + (f" ({tok_s[n] / tok_s['dynamic']:4.2f}x)" if n != "dynamic" else " " * 8)
                     for n in caches)  # fmt: skip
    return f"  {'':>16}{speed}  {'':>21}" + " ".join(f"{ratio[n]:6.3f}x [{band[n][0]:.3f}, {band[n][1]:.3f}]"
                                                      for n in caches[1:])  # fmt: skip


def median_interval(ratios: list[float], level: float = 0.9, draws: int = 2000) -> tuple[float, float]:
    """The ``level`` percentile bootstrap interval of the median of ``ratios`` (the rounds resampled with
    replacement, ``draws`` times, seeded)."""
    import random

    pick = random.Random(0).choices
    medians = sorted(statistics.median(pick(ratios, k=len(ratios))) for _ in range(draws))
    tail = (1 - level) / 2
    return medians[int(tail * (draws - 1))], medians[int((1 - tail) * (draws - 1))]


if __name__ == "__main__":
    main()
