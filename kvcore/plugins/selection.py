"""Backend selection: a pure, explainable function of the request and the registered backends.

Rules, in order:

1. ``kv_cache.backend`` names a backend: that one, or an error saying why it cannot serve the request (not
   registered, its plugin failed to load, or which capability does not match).
2. Otherwise every backend whose capabilities match (attention kind, kv dtype, device, vendor, page size)
   is a candidate; the most specific wins (names the requested vendor > names the device > generic), then
   the highest ``priority``.  Two candidates tied at the top is an error naming both; set
   ``kv_cache.backend`` to choose.
"""

from __future__ import annotations

import attrs

from kvcore.backend import BackendSpec, PoolRequest
from kvcore.errors import PluginError, SelectionError
from kvcore.kernels.addresses import shared_by_copies
from kvcore.plugins.manager import Registry


@attrs.frozen
class Candidate:
    backend: BackendSpec
    reasons: tuple[str, ...]  # empty when it matches

    @property
    def matches(self) -> bool:
        return not self.reasons


@attrs.frozen
class Selection:
    """The chosen backend and, for every registered backend, why it was or was not chosen."""

    __deepcopy__ = shared_by_copies

    backend: BackendSpec
    request: PoolRequest
    candidates: tuple[Candidate, ...]
    rule: str

    def explain(self) -> list[str]:
        lines = [f"selected backend {self.backend.name!r} (plugin {self.backend.plugin}): {self.rule}"]
        for c in self.candidates:
            if c.backend.name == self.backend.name:
                continue
            if c.matches:
                why = (
                    f"matches, but ranks lower (specificity {c.backend.specificity(self.request)}, "
                    f"priority {c.backend.priority})"
                )
                if self.rule.startswith("named by kv_cache.backend"):
                    why = "matches, but kv_cache.backend names another backend"
            else:
                why = "; ".join(c.reasons)
            lines.append(f"skipped {c.backend.name!r} (plugin {c.backend.plugin}): {why}")
        return lines


def _rank(backend: BackendSpec, request: PoolRequest) -> tuple[int, int]:
    return backend.specificity(request), backend.priority


def select_backend(registry: Registry, request: PoolRequest) -> Selection:
    """Pick the backend for ``request``; see the module docstring for the rules."""
    candidates = tuple(Candidate(b, tuple(b.mismatches(request))) for b in registry.backends.values())
    failures = "".join(f"\n  - {f.describe()}" for f in registry.failures)

    if request.backend != "auto":
        chosen = registry.backends.get(request.backend)
        if chosen is None:
            registered = ", ".join(sorted(registry.backends)) or "none"
            message = (
                f"kv_cache.backend={request.backend!r} is not a registered backend; registered: {registered} "
                "(see `kvcore plugins`)"
            )
            if registry.failures:
                raise PluginError(f"{message}; plugins that failed to load, one may provide it:{failures}")
            raise SelectionError(message)
        reasons = chosen.mismatches(request)
        if reasons:
            raise SelectionError(f"kv_cache.backend={request.backend!r} cannot serve this model: {'; '.join(reasons)}")
        return Selection(chosen, request, candidates, "named by kv_cache.backend")

    matching = sorted((c.backend for c in candidates if c.matches), key=lambda b: _rank(b, request), reverse=True)
    if not matching:
        details = tuple(f"{c.backend.name} ({c.backend.plugin}): {'; '.join(c.reasons)}" for c in candidates)
        served = [c for c in candidates if request.attention in c.backend.attention]
        if served:  # what those serving the model's attention lack, first: that is what to change
            fix = "; ".join(f"backend {c.backend.name!r} (plugin {c.backend.plugin}) serves it but: {'; '.join(c.reasons)}"
                            for c in served)  # fmt: skip
        elif registry.backends:
            kinds = sorted({kind for b in registry.backends.values() for kind in b.attention})
            fix = (f"no backend serves {request.attention} attention (they serve {', '.join(kinds)}): install a plugin "
                   "that does (`kvcore plugins` lists the backends)")  # fmt: skip
        else:
            fix = "no backends are registered (`kvcore plugins` lists the plugins loaded)"
        raise SelectionError(
            f"no registered backend serves attention={request.attention}, "
            f"kv dtype={request.kv_format or str(request.kv_dtype).removeprefix('torch.')}, device={request.device_type}, "
            f"vendor={request.vendor}, page size={request.page_size}: {fix}"
            + (f"\nplugins that failed to load:{failures}" if failures else ""),
            details,
        )
    best = matching[0]
    if len(matching) > 1 and _rank(matching[1], request) == _rank(best, request):
        other = matching[1]
        raise SelectionError(
            f"backends {best.name!r} (plugin {best.plugin}) and {other.name!r} (plugin {other.plugin}) both match "
            f"with equal specificity and priority; set kv_cache.backend to one of them"
        )
    specificity = ("generic", "device-specific", f"vendor {request.vendor}")[best.specificity(request)]
    rule = f"best match ({specificity}, priority {best.priority}) of {len(matching)} matching backend(s)"
    return Selection(best, request, candidates, rule)
