"""``kvcore check BACKEND``: certify an installed pool backend with the conformance kit, with nothing written
by its author beyond the plugin.

What runs comes from the backend's own :class:`~kvcore.backend.BackendSpec`:

- one *target* per attention kind it serves, each a small model: a shipped model of that attention kind, as
  small as there is (:func:`probe_model`), or the model the caller names (``kvcore check acme model=...``);
- *variants* covering every cache dtype and block format it serves, every page size it declares (1 and 16 when
  it declares none), every buffer layout it declares (``kv_cache.layout``) and the kernel modes asked for (on the CPU: the Triton kernels in the interpreter, then
  the torch path), each value at least once (``exhaustive=True``: every combination);
- for each target, the pool checks of :class:`kvcore.testing.KVCacheConformance` (and the lossy round trip
  for a pool that states a ``lossy_bound``) per variant, and the allocator the backend's
  ``kvcore_choose_allocator`` builds under :class:`kvcore.testing.BackendAllocatorConformance` per page size.

:func:`plan_check` works that out (nothing runs, nothing is allocated); :func:`run_check` runs it in a fresh
Python process, so that Triton's interpreter can be switched on before any kernel is imported and a crashing
kernel cannot take the caller down, and prints one line per check by name.  The exit status is 0 when every
check passed (skips by declared capability allowed) and non-zero otherwise.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch

from kvcore.backend import ANY, BackendSpec
from kvcore.errors import ConfigError

#: the environment variable carrying the plan (JSON) into the process that runs it
PLAN_ENV = "KVCORE_CHECK_PLAN"
#: a probe model longer than this is cut to :data:`PROBE_LAYERS` layers (tests stay small in the interpreter)
MAX_PROBE_LAYERS = 8
PROBE_LAYERS = 4
#: page sizes checked for a backend that declares none
DEFAULT_PAGE_SIZES = (1, 16)
#: plain cache dtypes checked for a backend that serves any
DEFAULT_DTYPES = ("bfloat16", "float8_e4m3fn")


@attrs.frozen
class CheckVariant:
    """One configuration every pool check of a target runs under (``kvcore.testing.Variant``'s fields)."""

    dtype: str
    kernels: str
    page_size: int
    overrides: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    @property
    def id(self) -> str:
        return "-".join([f"{self.dtype}-{self.kernels}-page{self.page_size}", *self.overrides])


@attrs.frozen
class CheckTarget:
    """One small model the backend serves, and the variants its checks run under.

    :param attention: the attention kind it probes.
    :param config: the config overrides of the model (``model=...`` and what shrinks it).
    :param source: where the model came from, for the report.
    """

    attention: str
    config: tuple[str, ...] = attrs.field(converter=tuple)
    source: str
    variants: tuple[CheckVariant, ...] = attrs.field(converter=tuple)

    @property
    def allocator_variants(self) -> tuple[CheckVariant, ...]:
        """One variant per page size: the allocator depends on the page size, not on the dtype."""
        seen: dict[int, CheckVariant] = {}
        for v in self.variants:
            seen.setdefault(v.page_size, v)
        return tuple(seen.values())


@attrs.frozen
class CheckPlan:
    """Everything :func:`run_check` runs, as plain data (it crosses into a fresh process as JSON)."""

    backend: str
    plugin: str
    device: str
    targets: tuple[CheckTarget, ...] = attrs.field(converter=tuple)
    plugins: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> CheckPlan:
        raw = json.loads(text)
        targets = [
            CheckTarget(t["attention"], t["config"], t["source"], [CheckVariant(**v) for v in t["variants"]])
            for t in raw.pop("targets")
        ]
        return cls(targets=targets, **raw)

    def describe(self) -> list[str]:
        lines = [f"backend    {self.backend} (plugin {self.plugin}) on {self.device}"]
        for t in self.targets:
            lines.append(f"target     {t.attention}: {' '.join(t.config)}  ({t.source})")
            lines.append(f"  variants {', '.join(v.id for v in t.variants)}")
        return lines


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _choose(what: str, asked: Sequence, served: Sequence, backend: str, flag: str) -> list:
    """``asked`` (all of ``served`` when empty), refusing anything the backend does not serve."""
    if not asked:
        return list(served)
    refused = [a for a in asked if a not in served]
    if refused:
        raise ConfigError(
            f"backend {backend!r} does not serve {what} {', '.join(map(str, refused))} (it serves "
            f"{', '.join(map(str, served))}); drop {flag} or pick one of those"
        )
    return list(asked)


def _covering(dtypes: list[str], kernels: list[str], pages: list[int], layouts: Sequence[str],
              exhaustive: bool) -> list[CheckVariant]:  # fmt: skip
    """Every combination, or the fewest variants in which each dtype, kernels mode, page size and buffer layout
    (``kv_cache.layout``, beyond the default) appears."""
    extra = [(f"kv_cache.layout={layout}",) for layout in layouts if layout != "token_major"]
    if exhaustive:
        return [CheckVariant(d, k, p, o) for d, k, p, o in itertools.product(dtypes, kernels, pages, [(), *extra])]
    variants = [CheckVariant(d, kernels[0], pages[0]) for d in dtypes]
    variants += [CheckVariant(dtypes[0], kernels[0], p) for p in pages[1:]]
    variants += [CheckVariant(dtypes[-1], k, pages[-1]) for k in kernels[1:]]
    variants += [CheckVariant(dtypes[0], k, pages[-1], o) for o in extra for k in kernels]
    return list(dict.fromkeys(variants))


def probe_model(attention: str, registry, vendor_overrides: Sequence[str]) -> tuple[list[str], str]:
    """The smallest shipped model of ``attention`` as config overrides: one short enough to check whole when
    there is one, else the one with the fewest parameters, cut to :data:`PROBE_LAYERS` layers.

    :raises ConfigError: when no shipped model has that attention kind, saying how to name one.
    """
    from kvcore.api import load_config
    from kvcore.config import available_options

    candidates = []
    for name in available_options("model"):
        try:
            model = load_config(f"model={name}", *vendor_overrides, registry=registry).model
        except ConfigError:
            continue  # a model another plugin's sections describe
        if model.attention == attention:
            # short enough to check whole (hybrid layer patterns intact) first, then the fewest parameters
            candidates.append((model.num_hidden_layers > MAX_PROBE_LAYERS, model.num_parameters, name, model.num_hidden_layers))
    if not candidates:
        raise ConfigError(
            f"no shipped model has attention={attention}; name a small one of yours: "
            f"kvcore check BACKEND model=PATH.yaml (a model file as under configs/model/)"
        )
    *_, name, layers = min(candidates)
    config = [f"model={name}"]
    if layers > MAX_PROBE_LAYERS:
        config.append(f"model.num_hidden_layers={PROBE_LAYERS}")
    return config, f"the smallest shipped {attention} model" + (f", cut to {PROBE_LAYERS} layers" if layers > MAX_PROBE_LAYERS else "")


def plan_check(
    registry,
    backend: str,
    *,
    device: str | None = None,
    dtypes: Sequence[str] = (),
    page_sizes: Sequence[int] = (),
    kernels: Sequence[str] = (),
    overrides: Sequence[str] = (),
    plugins: Sequence[str] = (),
    exhaustive: bool = False,
) -> CheckPlan:
    """What ``kvcore check`` runs for ``backend`` (see the module docstring); allocates nothing.

    :param overrides: config overrides added to every target; one that sets ``model=`` replaces the probe models.
    :param plugins: modules registered as plugins besides the installed ones (the plan carries them over).
    :raises ConfigError: for an unknown backend, or a device, dtype or page size it does not serve.
    """
    spec: BackendSpec | None = registry.backends.get(backend)
    if spec is None:
        raise ConfigError(
            f"no installed backend is named {backend!r}; installed: {', '.join(sorted(registry.backends))} "
            "(`kvcore plugins` lists them; --plugin MODULE adds a plugin that is not installed)"
        )
    devices = ["cpu", "cuda"] if ANY in spec.devices else [d for d in ("cpu", "cuda") if d in spec.devices]
    if device is None:
        device = devices[0] if devices else spec.devices[0]
    device = _choose("device", [device], devices, backend, "--device")[0]
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda needs a visible CUDA device, and this machine has none; check on the CPU "
                          "(--device cpu runs the Triton kernels in the interpreter) or run this on the GPU machine")  # fmt: skip
    served_dtypes = list(DEFAULT_DTYPES) if spec.kv_dtypes is None else [_dtype_name(d) for d in spec.kv_dtypes]
    dtypes = _choose("kv_cache.dtype", list(dtypes), served_dtypes + list(spec.kv_formats), backend, "--dtype")
    if spec.page_sizes is None:
        pages = list(page_sizes) or list(DEFAULT_PAGE_SIZES)
    else:
        pages = _choose("page size", list(page_sizes), list(spec.page_sizes), backend, "--page-size")
    default_kernels = ["triton", "native"] if device == "cpu" else ["auto"]
    kernels = list(kernels) or default_kernels

    vendor = [] if ANY in spec.vendors else [f"hardware.vendor={spec.vendors[0]}"]
    shared = ["parallel.tp_size=1", "parallel.pp_size=1", *vendor]
    user_model = any(o.startswith("model=") for o in overrides)
    targets = []
    for attention in spec.attention if not user_model else [None]:
        if user_model:
            from kvcore.api import load_config

            config = [*shared, *overrides]
            attention = load_config(*config, registry=registry).model.attention
            source = "the model named on the command line"
        else:
            probe, source = probe_model(attention, registry, shared)
            config = [*probe, *shared, *overrides]
        targets.append(CheckTarget(attention, config, source, _covering(dtypes, kernels, pages, spec.layouts, exhaustive)))
    return CheckPlan(backend=backend, plugin=spec.plugin, device=device, targets=targets, plugins=plugins)


def run_check(plan: CheckPlan, *, pytest_args: Sequence[str] = (), out=None) -> int:
    """Run ``plan`` in a fresh Python process (same working directory and ``PYTHONPATH``, so ``plan.plugins``
    import there as here) and stream its report; returns its exit status (0: all passed)."""
    out = out or sys.stdout
    env = dict(os.environ)
    env[PLAN_ENV] = plan.to_json()
    env.pop("KVCORE_TEST_COMPILED", None)
    env.pop("TRITON_INTERPRET", None)
    if plan.device == "cuda":
        env["KVCORE_TEST_COMPILED"] = "1"
    else:
        env["TRITON_INTERPRET"] = "1"
    with tempfile.TemporaryDirectory(prefix="kvcore-check-") as tmp:
        ini = Path(tmp) / "pytest.ini"
        ini.write_text("[pytest]\n", encoding="utf-8")  # the caller's own pytest settings stay out of it
        suite = Path(__file__).parents[1] / "testing" / "backend_check.py"
        command = [sys.executable, "-m", "kvcore.testing.backend_check", str(suite), "-c", str(ini),
                   "--rootdir", tmp, "-p", "no:cacheprovider", *pytest_args]  # fmt: skip
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            out.flush()
        return proc.wait()
