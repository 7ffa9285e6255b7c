"""``kvcore`` command line: ``up``, ``plan``, ``plugins``, ``config``, ``bench``, ``check``.

Every command takes an optional engine YAML first, then overrides::

    kvcore up                                        # embedded CPU default
    kvcore plan model=llama-3-70b hardware=h200 parallel.tp_size=8
    kvcore plugins --explain model=llama-3-8b hardware=h100 kv_cache.dtype=float8_e4m3fn
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

import kvcore
from kvcore.errors import ConfigError, KVCoreError, SelectionError

if TYPE_CHECKING:
    from kvcore.config import EngineConfig
    from kvcore.planning.planner import MemoryPlan

# The library (and torch with it) is imported by the commands that use it, not here: `kvcore --help` and a bad
# argument answer without waiting for torch.

GiB = 1 << 30


def _split_args(args: Sequence[str]) -> tuple[str | None, list[str]]:
    if args and "=" not in args[0] and args[0].endswith((".yaml", ".yml")):
        return args[0], list(args[1:])
    return None, list(args)


def _load(args: Sequence[str]) -> EngineConfig:
    path, overrides = _split_args(args)
    return kvcore.load_config(*overrides, path=path)


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def _describe_config(cfg: EngineConfig) -> list[str]:
    start, end = cfg.layer_range
    m = cfg.model
    return [
        f"model      {m.name} ({m.architecture}): {m.attention} attention, {m.num_hidden_layers} layers, "
        f"{m.num_parameters / 1e9:.2f}B params, {m.dtype}",
        f"hardware   {cfg.hardware.name}: {cfg.hardware.device} ({cfg.hardware.vendor}), "
        f"{cfg.hardware.memory_gib:g} GiB, kernels={cfg.hardware.kernels}",
        f"parallel   tp={cfg.parallel.tp_size} pp={cfg.parallel.pp_size}"
        + (f" cp={cfg.parallel.cp_size} (cp rank {cfg.parallel.cp_rank})" if cfg.parallel.cp_size > 1 else "")
        + f" (this rank: layers {start}..{end - 1})",
        f"kv cache   dtype={cfg.kv_format or str(cfg.kv_dtype).removeprefix('torch.')} page_size={cfg.kv_cache.page_size} "
        f"backend={cfg.kv_cache.backend}",
        *_describe_modes(cfg),
    ]


def _describe_modes(cfg: EngineConfig) -> list[str]:
    """The engine modes, when one is on: speculative decoding and disaggregation."""
    lines = []
    spec, dis = cfg.speculative, cfg.disaggregation
    if spec.enabled:
        draft = (f"the model's {cfg.model.num_nextn_predict_layers} MTP layer(s)" if spec.algorithm == "nextn"
                 else spec.draft_model)  # fmt: skip
        lines.append(f"speculative {spec.algorithm}: draft {draft}, {spec.num_draft_tokens} draft tokens, "
                     f"topk {spec.eagle_topk}")  # fmt: skip
    if dis.mode != "null":
        lines.append(f"disaggregation {dis.mode} worker: allocators keep freed slots sorted (need_sort)")
    return lines


def _describe_plan(plan: MemoryPlan) -> list[str]:
    b = plan.budget
    lines = [
        f"budget     {b.source}",
        f"           - weights per rank {_gib(b.weight_bytes)} - runtime slack {_gib(b.slack_bytes)} "
        f"= KV budget {_gib(b.kv_budget_bytes)}; the request table ({_gib(plan.req_to_token_bytes)}) comes on top",
        f"backend    {plan.backend}",
        *(f"  buffer   {buf.describe()}" for buf in plan.layout.buffers),
        f"per token  {plan.bytes_per_token} bytes per token per rank"
        + (f" (full layers), {math.ceil(plan.layout.bytes_per_unit('swa_tokens'))} per sliding-window token"
           if plan.swa_max_total_num_tokens is not None else ""),
        f"tokens     max_total_num_tokens = {plan.max_total_num_tokens} (page-aligned to {plan.page_size}"
        + (f"; pipeline rank {plan.limiting_pp_rank} limits" if plan.pp_size > 1 else "")
        + ")",
    ]
    if plan.swa_max_total_num_tokens is not None:
        lines += [
            f"           = full_max_total_num_tokens; swa_max_total_num_tokens = {plan.swa_max_total_num_tokens} "
            f"(memory.swa_full_tokens_ratio = {plan.swa_max_total_num_tokens / max(1, plan.max_total_num_tokens):.3f})"
        ]
    lines += [f"           {name} = {size} ({group} / {divisor})" for name, size, (group, divisor)
              in zip(plan.derived_sizes, plan.derived_sizes.values(), plan.layout.derived_sizes.values())]  # fmt: skip
    if plan.max_mamba_cache_size is not None:
        state = sum(b.total_bytes(plan.sizes[b.sized_by]) for b in plan.layout.buffers
                    if b.sized_by in ("requests", "running_requests"))  # fmt: skip
        sizing = plan.layout.request_state
        slots = (f"{plan.max_mamba_cache_size} request slots (the request table's rows: max_running_requests + 1)"
                 if sizing is not None and sizing.per_request_table_row else
                 f"max_mamba_cache_size = {plan.max_mamba_cache_size} slots")  # fmt: skip
        lines.append(f"state      {slots} of per-request state, {_gib(state)} (reserved before the KV tokens: "
                     f"{_gib(plan.kv_cache_bytes - state)})")
    if plan.draft_layout is not None:
        lines += [
            f"draft      {plan.draft_layout.backend}: the draft model's pool, at the target's tokens",
            *(f"  buffer   {buf.describe()}" for buf in plan.draft_layout.buffers),
            f"per token  {plan.bytes_per_token} target + {plan.draft_bytes_per_token} draft = "
            f"{plan.cell_bytes_per_token} bytes per token per rank (the cell size the tokens are solved with)",
            f"           draft weights {_gib(plan.draft_weight_bytes)} charged with the target's; draft pool "
            f"{_gib(plan.draft_kv_cache_bytes)}",
        ]
    rows = plan.max_running_requests + plan.pre_alloc_size
    table = f"{rows} rows" + (f", {plan.pre_alloc_size} pre-allocated for arriving requests" if plan.pre_alloc_size else "")
    lines += [
        f"requests   max_running_requests = {plan.max_running_requests} (context {plan.context_length}; request "
        f"table rows of {plan.request_context_len} tokens, {table})",
        f"memory     KV pools {_gib(plan.kv_cache_bytes + plan.draft_kv_cache_bytes)} + request table "
        f"{_gib(plan.req_to_token_bytes)}",
    ]
    if plan.unified is not None:
        lines += plan.unified.describe()
    lines += [f"warning    {w}" for w in plan.warnings]
    lines += [f"note       {n}" for n in plan.layout.notes]
    return lines


def _print(lines: Sequence[str]) -> None:
    for line in lines:
        print(line, flush=True)


#: the cache dtypes ``kvcore plan`` sets side by side
COMPARED_DTYPES = ("bfloat16", "float8_e4m3fn", "mxfp8", "nvfp4", "fp4_e2m1")


def _compare_dtypes(cfg: EngineConfig) -> list[str]:
    """What the same budget holds at each of :data:`COMPARED_DTYPES` (a dtype no backend serves for this model
    says why)."""
    lines = ["by dtype   the same budget at each kv_cache.dtype:",
             f"           {'dtype':<14} {'bytes/token':>12} {'tokens':>12} {'requests':>9}  backend"]  # fmt: skip
    for name in COMPARED_DTYPES:
        other = attrs.evolve(cfg, kv_cache=attrs.evolve(cfg.kv_cache, dtype=name))
        try:
            plan = kvcore.api.plan_memory(other)
        except SelectionError:
            lines.append(f"           {name:<14} {'-':>12} {'-':>12} {'-':>9}  no backend serves {cfg.model.attention} at it")
            continue
        except KVCoreError as exc:
            lines.append(f"           {name:<14} {'-':>12} {'-':>12} {'-':>9}  {str(exc).splitlines()[0][:100]}")
            continue
        lines.append(f"           {name:<14} {plan.cell_bytes_per_token:>12} {plan.max_total_num_tokens:>12} "
                     f"{plan.max_running_requests:>9}  {plan.backend}")  # fmt: skip
    return lines


def cmd_plan(args: argparse.Namespace) -> int:
    if args.sweep:
        return _plan_sweep(args)
    if args.plot:
        raise ConfigError("--plot draws a sweep: add --sweep KEY=V1,V2,... (e.g. --sweep parallel.tp_size=1,2,4,8)")
    cfg = _load(args.overrides)
    _print(_describe_config(cfg))
    _print(_describe_plan(kvcore.api.plan_memory(cfg)))
    _print(_compare_dtypes(cfg))
    return 0


def _plan_sweep(args: argparse.Namespace) -> int:
    """``kvcore plan ... --sweep KEY=V1,V2 [--sweep ...] [--plot FILE.png]``: one table over the product."""
    from kvcore.tools.sweep import parse_sweep, plot, run_sweep, table, title

    path, overrides = _split_args(args.overrides)
    sweeps = [parse_sweep(text) for text in args.sweep]
    cfg = kvcore.load_config(*overrides, path=path)
    heading = title(cfg.model.name, cfg.hardware.name, sweeps)
    total = 1
    for _, values in sweeps:
        total *= len(values)
    print(f"sweep      {heading} ({total} plans, nothing allocated)", flush=True)
    points = run_sweep(overrides, sweeps, path=path)
    _print(table(points))
    if args.plot:
        print(f"plot       {plot(points, args.plot, heading)}")
    return 0 if any(not p.error for p in points) else 2


def cmd_up(args: argparse.Namespace) -> int:
    """Plan, allocate and self-check.  Under ``torchrun`` every rank does so for its own stage and heads, the
    sizes agreed over the ranks; rank 0 prints the report, every rank its own result."""
    import torch

    from kvcore.planning import distributed

    cfg = _load(args.overrides)
    kvcore.api.check_device_visible(cfg)  # before any plan is printed: a GPU profile on a CPU machine is one line
    if not distributed.init_from_env(cfg.hardware.device):
        return _up(cfg, "", _print, args.explain)
    try:
        cfg, where = distributed.rank_config(cfg)
        print(f"[rank {where.rank}] {where.describe()}: layers {cfg.layer_range[0]}..{cfg.layer_range[1] - 1}", flush=True)
        return _up(cfg, f"[rank {where.rank}] ", _print if where.rank == 0 else _print_nothing, args.explain)
    finally:
        torch.distributed.destroy_process_group()


def _selection_lines(selection, explain: bool) -> list[str]:
    """The chosen backend's line, then every other backend's (``explain``) or one line counting them."""
    lines = selection.explain()
    if explain or len(lines) == 1:
        return lines
    return [lines[0], f"{len(lines) - 1} other backends not chosen (`--explain` says why each is not)"]


def _up(cfg: EngineConfig, rank: str, report, explain: bool = False) -> int:
    """``kvcore up`` for one rank: ``rank`` prefixes the lines every rank prints, ``report`` prints the rest."""
    import torch

    from kvcore.planning import distributed
    from kvcore.tools.selfcheck import run_self_check

    report(["[1/4] config"] + ["  " + line for line in _describe_config(cfg)])
    registry = kvcore.plugins.get_registry()
    selection = kvcore.api.select(cfg, registry)
    report(["[2/4] backend"] + ["  " + line for line in _selection_lines(selection, explain)])
    free = None
    if cfg.hardware.device == "cuda" and torch.cuda.is_available():
        free = torch.cuda.mem_get_info()[0]
    plan = kvcore.api.plan_memory(cfg, registry=registry, free_memory_bytes=free)
    if rank:
        plan = distributed.agree(plan)
    report(["[3/4] plan (nothing allocated yet)"] + ["  " + line for line in _describe_plan(plan)])
    kvcore.api.check_buildable(cfg)  # after the plan, which says what a config kvcore cannot build yet would hold
    total = plan.kv_cache_bytes + plan.draft_kv_cache_bytes + plan.req_to_token_bytes
    report([f"[4/4] allocating {_gib(total)} on {cfg.hardware.device} ..."])
    started = time.perf_counter()
    pools = kvcore.api.build_pools(cfg, registry=registry, plan=plan)
    allocated = sum(buf.nbytes for buf in pools.token_to_kv_pool.buffers().values())
    print(f"  {rank}allocated {_gib(allocated)} of KV pools in {time.perf_counter() - started:.2f} s "
          f"({type(pools.token_to_kv_pool).__name__}, {type(pools.token_to_kv_pool_allocator).__name__})")
    if allocated != plan.kv_cache_bytes:
        print(f"  {rank}FAIL layout declared {plan.kv_cache_bytes} bytes, pool allocated {allocated}")
        return 1
    results = run_self_check(pools)
    if pools.draft is not None:
        draft_pool = pools.draft.token_to_kv_pool
        draft_bytes = sum(buf.nbytes for buf in draft_pool.buffers().values())
        print(f"  {rank}allocated {_gib(draft_bytes)} of the draft's pool ({type(draft_pool).__name__}, "
              f"{draft_pool.layer_num} layer(s)), sharing the target's request table and allocator")  # fmt: skip
        if draft_bytes != plan.draft_kv_cache_bytes:
            print(f"  {rank}FAIL the draft's layout declared {plan.draft_kv_cache_bytes} bytes, its pool allocated "
                  f"{draft_bytes}")  # fmt: skip
            return 1
        results += [attrs.evolve(r, name=f"draft {r.name}") for r in run_self_check(pools.draft)]
    width = max(12, *(len(r.name) for r in results))
    for r in results:
        print(f"  {rank}{'ok  ' if r.ok else 'FAIL'} {r.name:<{width}} {r.detail}")
    failed = [r for r in results if not r.ok]
    shared = ("" if plan.unified is None else f" (one unified memory: up to {plan.unified.max_tokens} tokens or "
              f"{plan.unified.max_other} {plan.unified.other_counted})")  # fmt: skip
    print(f"{rank}kvcore up: {'FAILED' if failed else 'ready'}: {plan.max_total_num_tokens} tokens, "
          f"{plan.max_running_requests} requests, backend {plan.backend}{shared}", flush=True)
    return 1 if failed else 0


def _print_nothing(lines: Sequence[str]) -> None:
    del lines


def cmd_plugins(args: argparse.Namespace) -> int:
    from kvcore.hookspecs import API_VERSION

    registry = kvcore.plugins.get_registry()
    print("backends:")
    for backend in sorted(registry.backends.values(), key=lambda b: b.name):
        dtypes = "any" if backend.kv_dtypes is None else ", ".join(str(d).removeprefix("torch.") for d in backend.kv_dtypes)
        dtypes = ", ".join(filter(None, [dtypes, *backend.kv_formats])) or "none"
        print(f"  {backend.name:<10} plugin={backend.plugin:<10} attention={'/'.join(backend.attention)} "
              f"dtypes={dtypes} devices={'/'.join(backend.devices)} vendors={'/'.join(backend.vendors)} "
              f"priority={backend.priority}")
        if backend.description:
            print(f"             {backend.description}")
    print("plugins loaded: " + (", ".join(registry.plugins) or "none"))
    undeclared = [name for name in registry.plugins if registry.api_versions.get(name) is None]
    print(f"plugin API: {API_VERSION} (kvcore.hookspecs.API_VERSION)"
          + (f"; not declaring KVCORE_API_VERSION (loaded unchecked): {', '.join(undeclared)}" if undeclared else ""))
    for name, why in sorted(registry.skipped.items()):
        print(f"plugin skipped: {name} ({why})")
    for failure in registry.failures:
        print(f"plugin FAILED: {failure.describe()}")
    if args.explain is not None:
        cfg = _load(args.explain)
        print(f"explain for model={cfg.model.name} hardware={cfg.hardware.name} (device {cfg.hardware.device}, "
              f"vendor {cfg.hardware.vendor}):")
        _print("  " + line for line in kvcore.api.select(cfg, registry).explain())
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from kvcore.config import all_keys, keys_markdown

    keys = all_keys(kvcore.plugins.get_registry())
    if args.markdown:
        print(keys_markdown(keys), end="")
        return 0
    width = max(len(k.path) for k in keys)
    for k in keys:
        print(f"{k.path:<{width}}  {k.type:<12} {('[' + k.default + ']'):<12} {k.doc}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("kvcore bench: needs a CUDA GPU, and this machine has none: it times the pools' kernels on the device "
              "(`kvcore plan` sizes pools and the test suite checks every kernel on a CPU without one)", file=sys.stderr)
        return 2
    from kvcore.tools.bench import run

    sizes = dict(host_sizes=(8,), graph_sizes=(1, 64), reps=500, engine_steps=100) if args.quick else {}
    rows = run(**sizes)
    if args.json:
        import json

        import attrs

        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([attrs.asdict(r) for r in rows], f, indent=1)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    import importlib

    from kvcore.tools.check import plan_check, run_check
    from kvcore.plugins import load_registry

    registry = kvcore.plugins.get_registry()
    if args.plugin:
        registry = load_registry(extra_plugins=[(name, importlib.import_module(name)) for name in args.plugin])
    plan = plan_check(
        registry, args.backend, device=args.device, dtypes=args.dtype or (), page_sizes=args.page_size or (),
        kernels=args.kernels or (), overrides=args.overrides, plugins=args.plugin or (), exhaustive=args.exhaustive,
    )  # fmt: skip
    _print([f"kvcore check {args.backend}: the conformance kit, through the hooks engines use"] + plan.describe())
    pytest_args = (["--hypothesis-profile=long"] if args.long else []) + (["-k", args.only] if args.only else [])
    return 1 if run_check(plan, pytest_args=pytest_args) else 0


def _comma_list(kind, choices: Sequence[str] | None = None, positive: bool = False):
    """An argparse type: ``a,b`` -> ``[kind(a), kind(b)]`` (options repeat or take comma lists); ``positive``:
    every value above 0."""

    def parse(text: str) -> list:
        try:
            values = [kind(part) for part in text.split(",") if part]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {kind.__name__}") from None
        bad = [v for v in values if choices is not None and v not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"invalid choice {bad[0]!r} (choose from {', '.join(choices)})")
        if positive and any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: each value must be a positive {kind.__name__}")
        if not values:
            raise argparse.ArgumentTypeError("give at least one value")
        return values

    return parse


def _shipped() -> str:
    """The shipped model and hardware options, for help texts (read from the config files: no torch)."""
    from kvcore.config.files import available_options

    return (f"shipped models: {', '.join(available_options('model'))}\n"
            f"shipped hardware: {', '.join(available_options('hardware'))}\n"
            "any model given as model=hf:PATH (a Hugging Face config.json), any file as model=PATH.yaml")  # fmt: skip


UP_HELP = """Plan, allocate and self-check the pools of a config: the config, the backend chosen, the memory plan,
then the pools built on the device and checked (write, read, move, CPU offload, free).  With no argument it runs
the embedded CPU default (Qwen2.5-0.5B on a 2 GiB CPU budget)."""
PLAN_HELP = """Size the pools of a config without allocating anything (a GPU profile plans on a CPU machine): the
budget, every buffer's bytes per token, the tokens and requests that fit, and the same budget at each cache
dtype side by side."""
CONFIG_EXAMPLES = """examples:
  kvcore {cmd}
  kvcore {cmd} model=llama-3-8b hardware=h200 kv_cache.page_size=16
  kvcore {cmd} model=deepseek-v3 hardware=h200 kv_cache.dtype=float8_e4m3fn
  kvcore {cmd} my-engine.yaml memory.max_total_tokens=100000

"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcore", description="KV-cache memory pools: plan, build and check.",
                                     epilog="`kvcore COMMAND --help` says more of each command; `kvcore config` lists "
                                     "every config key.")  # fmt: skip
    parser.add_argument("--version", action="version", version=f"kvcore {kvcore.__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    help_overrides = "optional engine YAML, then overrides: model=NAME hardware=NAME key.path=value"
    raw = argparse.RawDescriptionHelpFormatter
    up = sub.add_parser("up", help="plan, allocate and self-check the pools (default: embedded CPU config)",
                        description=UP_HELP, epilog=CONFIG_EXAMPLES.format(cmd="up") + _shipped(), formatter_class=raw)
    up.add_argument("overrides", nargs="*", help=help_overrides)
    up.add_argument("--explain", action="store_true", help="say why every other backend is not chosen")
    up.set_defaults(func=cmd_up)
    plan = sub.add_parser("plan", help="size the pools without allocating (works for GPU profiles on a CPU)",
                          description=PLAN_HELP, formatter_class=raw,
                          epilog=CONFIG_EXAMPLES.format(cmd="plan") + "  kvcore plan model=llama-3-70b hardware=h200 "
                          "--sweep parallel.tp_size=2,4,8\n\n" + _shipped())  # fmt: skip
    plan.add_argument("overrides", nargs="*", help=help_overrides)
    plan.add_argument("--explain", action="store_true", help="when no backend serves the config, say why each does not")
    plan.add_argument("--sweep", action="append", metavar="KEY=V1,V2,...",
                      help="plan every combination of these values (repeatable): a table of tokens, requests, bytes per "
                      "token and KV GiB")
    plan.add_argument("--plot", metavar="FILE.png", help="with --sweep: draw tokens against the first swept key, one line "
                      "per combination of the others (needs matplotlib: the plot extra)")
    plan.set_defaults(func=cmd_plan)
    plugins = sub.add_parser("plugins", help="list backends and the plugins that registered them")
    plugins.add_argument("--explain", nargs="*", metavar="OVERRIDE",
                         help="for this config, say which backend is chosen and why the others are not")
    plugins.set_defaults(func=cmd_plugins)
    bench = sub.add_parser("bench", help="time the built-in pools' hot paths on this GPU beside the torch path")
    bench.add_argument("--quick", action="store_true", help="a few sizes only")
    bench.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    bench.set_defaults(func=cmd_bench)
    check = sub.add_parser("check", help="certify an installed backend: the conformance kit on small pools it builds")
    check.add_argument("backend", help="the backend's registered name (`kvcore plugins` lists them)")
    check.add_argument("overrides", nargs="*", help="config overrides for every check; model=NAME|PATH.yaml replaces "
                       "the probe models (default: the smallest shipped model of each attention kind it serves)")
    check.add_argument("--device", choices=("cpu", "cuda"), help="where the pools live (default: cpu when served; "
                       "on cpu the Triton kernels run in the interpreter)")
    check.add_argument("--dtype", action="extend", type=_comma_list(str), metavar="DTYPE[,DTYPE]",
                       help="kv_cache.dtype values (default: every one it serves)")
    check.add_argument("--page-size", action="extend", type=_comma_list(int, positive=True), metavar="N[,N]",
                       help="page sizes (default: every one it declares, or 1 and 16)")
    check.add_argument("--kernels", action="extend", type=_comma_list(str, ("auto", "triton", "native")), metavar="MODE[,MODE]",
                       help="hardware.kernels modes: auto, triton, native (default: triton,native on cpu, auto on cuda)")
    check.add_argument("--plugin", action="append", metavar="MODULE", help="also register this module as a plugin (repeatable)")
    check.add_argument("--long", action="store_true", help="the allocator checks' long run (10,000 request "
                       "lifetimes per allocator: hypothesis profile 'long'; minutes)")
    check.add_argument("--only", metavar="EXPR", help="run only the checks whose names match this pytest -k expression "
                       "(e.g. --only padding_page_untouched, or 'round_trip or move')")
    check.add_argument("--exhaustive", action="store_true", help="every combination of dtype, kernels and page size "
                       "(default: each value at least once)")
    check.set_defaults(func=cmd_check)
    config = sub.add_parser("config", help="every config key: type, default and meaning (plugins' sections and options too)")
    config.add_argument("--markdown", action="store_true", help="as the markdown table of docs/configuration.md")
    config.set_defaults(func=cmd_config)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and getattr(args, "overrides", None) is not None and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]  # overrides written after options (`check X --dtype Y key=v`)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    planner_log = logging.getLogger("kvcore.planning.planner")
    level = planner_log.level
    if not args.verbose:  # the reports print every plan's warnings themselves (`warning ...` lines), once
        planner_log.setLevel(logging.ERROR)
    try:
        return args.func(args)
    except KVCoreError as exc:
        print(f"kvcore: error: {exc}", file=sys.stderr)
        details = getattr(exc, "details", ())
        if details and getattr(args, "explain", None):
            print("\n".join(f"  - {line}" for line in details), file=sys.stderr)
        elif details:
            print(f"  (`--explain` says why each of the {len(details)} registered backends does not serve it)",
                  file=sys.stderr)
        return 2
    finally:
        planner_log.setLevel(level)  # an engine calling main() keeps its own logging


if __name__ == "__main__":
    sys.exit(main())
