"""The tests ``kvcore check`` runs, generated from the :class:`kvcore.tools.check.CheckPlan` in ``$KVCORE_CHECK_PLAN``,
and the runner that reports them one line per check.

Run as ``python -m kvcore.testing.backend_check THIS_FILE PYTEST_ARGS...`` (what :func:`kvcore.tools.check.run_check`
does, in a fresh process with ``TRITON_INTERPRET`` or ``KVCORE_TEST_COMPILED`` already set).  Per target of the
plan it defines ``TestPool_<attention>`` (the pool checks, per variant) and ``TestAllocator_<attention>`` (the
allocator checks, per page size).  Without a plan in the environment the module defines no tests, so a test
run that happens to collect it does nothing.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

from kvcore.tools.check import PLAN_ENV, CheckPlan
from kvcore.testing import (
    CAPABILITIES,
    LOSSY,
    BackendAllocatorConformance,
    BaseLossyTests,
    KVCacheConformance,
    Variant,
)


def _registry(plan: CheckPlan):
    from kvcore.plugins import get_registry, load_registry

    if not plan.plugins:
        return get_registry()
    return load_registry(extra_plugins=[(name, importlib.import_module(name)) for name in plan.plugins])


def _define(plan: CheckPlan, namespace: dict) -> None:
    registry = _registry(plan)

    class _Target:
        backend = plan.backend

        @pytest.fixture
        def kv_registry(self):
            return registry

    class _Pool(_Target, KVCacheConformance, BaseLossyTests):
        @pytest.fixture
        def kv_capabilities(self, kv_pool):
            """The default capabilities, and :data:`LOSSY` for a pool that states a ``lossy_bound``; none for a pool
            without token rows (it stores nothing: only its layout is checked)."""
            if not kv_pool.token_rows():
                return set()
            lossy = getattr(kv_pool, "lossy_bound", None) is not None
            return set(CAPABILITIES) | ({LOSSY} if lossy else set())

    class _Allocator(_Target, BackendAllocatorConformance):
        pass

    for target in plan.targets:
        def variants(which):
            return [Variant(v.dtype, v.kernels, v.page_size, v.overrides) for v in which]

        for prefix, base, chosen in (("TestPool", _Pool, target.variants), ("TestAllocator", _Allocator, target.allocator_variants)):  # fmt: skip
            name = f"{prefix}_{target.attention}"
            namespace[name] = type(name, (base,), {"config": list(target.config), "variants": variants(chosen)})


if os.environ.get(PLAN_ENV) and __name__ != "__main__":
    _define(CheckPlan.from_json(os.environ[PLAN_ENV]), globals())


# -- the runner ------------------------------------------------------------------------------------------------


def _check_name(nodeid: str) -> str:
    """``pool  mha  round_trip_only_target_rows_change[...]`` from a node id."""
    parts = nodeid.split("::")
    cls, test = parts[-2], parts[-1]
    kind, _, attention = cls.removeprefix("Test").partition("_")
    return f"{kind.lower():<9} {attention:<9} {test.removeprefix('test_')}"


def _message(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (path, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(longrepr)
    lines = [line for line in text.splitlines() if line.strip()]
    return " / ".join(lines[:4])


class Reporter:
    """Prints every check by name as it finishes, and the totals at the end."""

    def __init__(self) -> None:
        self.counts = {"ok": 0, "FAIL": 0, "skip": 0}
        self.skip_reasons: dict[str, int] = {}

    def _line(self, status: str, nodeid: str, message: str = "") -> None:
        self.counts[status] += 1
        print(f"  {status:<4}  {_check_name(nodeid)}" + (f": {message}" if message else ""), flush=True)

    def pytest_collectreport(self, report):
        if report.failed:  # an import error: its last line says what
            self.counts["FAIL"] += 1
            lines = [line.strip() for line in str(report.longrepr).splitlines() if line.strip()]
            print(f"  FAIL  collecting the checks: {lines[-1] if lines else 'unknown error'}", flush=True)

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self._line("FAIL", report.nodeid, f"{'in ' + report.when + ': ' if report.when != 'call' else ''}{_message(report)}")
        elif report.skipped:  # by declared capability: summed up by reason at the end
            self.counts["skip"] += 1
            reason = _message(report)
            self.skip_reasons[reason] = self.skip_reasons.get(reason, 0) + 1
        elif report.when == "call":
            self._line("ok", report.nodeid)

    def pytest_sessionfinish(self, session, exitstatus):
        c = self.counts
        for reason, n in sorted(self.skip_reasons.items()):
            print(f"  skip  {n} check{'s' if n > 1 else ''}: {reason}", flush=True)
        verdict = "FAILED" if c["FAIL"] or exitstatus not in (0,) else "passed"
        print(f"kvcore check: {verdict}: {c['ok']} passed, {c['FAIL']} failed, {c['skip']} skipped", flush=True)


def main(argv: list[str]) -> int:
    status = pytest.main(["-p", "kvcore.testing", "-p", "no:terminal", *argv], plugins=[Reporter()])
    return int(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
