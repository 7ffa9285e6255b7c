"""Plugin manager: loads the core defaults and every ``kvcore`` entry point, and collects their backends.

Environment switches (read when the registry loads):

``KVCORE_PLUGINS``
    Comma-separated entry-point names: load only these (an allow list).
``KVCORE_DISABLE_PLUGINS``
    Comma-separated entry-point names never to load (a block list).
``KVCORE_STRICT_PLUGINS=1``
    Any plugin failure (import error, misspelt hook, malformed record, duplicate backend) is fatal.

Without strict mode a broken plugin is logged with its name and skipped; it only stops kvcore when the
request selects one of its backends (or names a backend nobody registered while that plugin is broken),
and then the error carries the plugin's original failure.

API versions: a plugin module may declare ``KVCORE_API_VERSION = "N"`` (a string, ``major[.minor]``), the
:data:`kvcore.hookspecs.API_VERSION` it was written for.  Before any of its hooks is registered, a declared major
other than the core's (or a declaration that is not such a string) makes it a failed plugin at stage
``version``, with a message naming the plugin, both versions and what to do; ``kvcore plugins`` lists it, and
``KVCORE_STRICT_PLUGINS=1`` makes it fatal.  A plugin that declares nothing loads as before (unchecked).
"""

from __future__ import annotations

import logging
import os
import re
import traceback
from collections.abc import Iterable, Mapping
from importlib import metadata
from types import MappingProxyType
from typing import Any

import attrs
import pluggy

from kvcore import hookspecs
import kvcore.plugins.builtin as builtin
from kvcore.backend import BackendSpec
from kvcore.errors import PluginError

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "kvcore"
CORE_PLUGIN_NAME = "kvcore.plugins.builtin"
#: the module attribute a plugin declares its plugin API version in
VERSION_ATTRIBUTE = "KVCORE_API_VERSION"
_VERSION_RE = re.compile(r"([0-9]+)(?:\.([0-9]+))?")


@attrs.frozen
class PluginFailure:
    """A plugin that did not load, and why."""

    plugin: str
    stage: str  # "import", "version", "hooks", "register"
    error: str

    def describe(self) -> str:
        return f"plugin {self.plugin!r} failed at {self.stage}: {self.error}"


def api_major(version: str) -> int:
    """The major of an API version string (``"4"``, ``"4.1"``).

    :raises ValueError: for anything else.
    """
    match = _VERSION_RE.fullmatch(version) if isinstance(version, str) else None
    if match is None:
        raise ValueError(f"{version!r} is not an API version: a string, major[.minor], e.g. {hookspecs.API_VERSION!r}")
    return int(match.group(1))


def version_problem(name: str, plugin: Any) -> str | None:
    """Why plugin ``name`` cannot load under this core's :data:`~kvcore.hookspecs.API_VERSION`, or None (it
    declares the core's major, or declares nothing)."""
    declared = getattr(plugin, VERSION_ATTRIBUTE, None)
    if declared is None:
        return None
    core = hookspecs.API_VERSION
    try:
        major = api_major(declared)
    except ValueError:
        return (
            f"declares {VERSION_ATTRIBUTE} = {declared!r} ({type(declared).__name__}), which is not an API version; "
            f"write the version it was written for as a string, major[.minor] (this kvcore's is "
            f"{VERSION_ATTRIBUTE} = {core!r})"
        )
    if major == api_major(core):
        return None
    if major < api_major(core):
        fix = (f"install a release of plugin {name!r} written for plugin API {api_major(core)}, or port it "
               "(docs/writing-a-backend.md says what each version changed)")  # fmt: skip
    else:
        fix = f"upgrade kvcore to one of plugin API {major}, or install an older release of plugin {name!r}"
    return (
        f"written for kvcore plugin API {declared} ({VERSION_ATTRIBUTE} = {declared!r}), but this kvcore's plugin API "
        f"is {core} (kvcore.hookspecs.API_VERSION); {fix}; or disable it with KVCORE_DISABLE_PLUGINS={name}"
    )


def _names(value: str | None) -> set[str] | None:
    if value is None or not value.strip():
        return None
    return {n.strip() for n in value.split(",") if n.strip()}


@attrs.define(eq=False)
class Registry:
    """The loaded plugins, the backends they offer and the plugins that failed.

    ``backends`` is a read-only mapping ``name -> BackendSpec``.
    """

    manager: pluggy.PluginManager
    _backends: dict[str, BackendSpec] = attrs.field(factory=dict)
    failures: list[PluginFailure] = attrs.field(factory=list)
    plugins: list[str] = attrs.field(factory=list)
    skipped: dict[str, str] = attrs.field(factory=dict)
    strict: bool = False
    #: the ``KVCORE_API_VERSION`` each loaded plugin declares (None: declares none)
    api_versions: dict[str, str | None] = attrs.field(factory=dict)

    @property
    def hook(self):
        return self.manager.hook

    @property
    def backends(self) -> Mapping[str, BackendSpec]:
        return MappingProxyType(self._backends)

    @property
    def model_sections(self) -> tuple[tuple[str, type], ...]:
        """Every ``model.<name>`` section the registered backends declare, as sorted ``(name, schema)`` pairs
        (what :func:`kvcore.load_config` adds to the schema)."""
        return tuple(sorted({n: t for b in self._backends.values() for n, t in b.model_sections.items()}.items()))

    @property
    def kv_formats(self) -> tuple[str, ...]:
        """Every block-scaled cache format (``kv_cache.dtype`` names) the registered backends serve, sorted."""
        return tuple(sorted({f for b in self._backends.values() for f in b.kv_formats}))

    def failure_of(self, plugin: str) -> PluginFailure | None:
        return next((f for f in self.failures if f.plugin == plugin), None)

    def _fail(self, plugin: str, stage: str, error: str) -> None:
        failure = PluginFailure(plugin, stage, error)
        if self.strict:
            raise PluginError(failure.describe() + " (KVCORE_STRICT_PLUGINS=1 makes every plugin failure fatal)")
        logger.warning("%s; skipping it (set KVCORE_STRICT_PLUGINS=1 to make this fatal)", failure.describe())
        self.failures.append(failure)

    def register(self, plugin: Any, name: str) -> bool:
        """Register one plugin object and collect its backends.  Returns False when it failed.

        A plugin declaring another major plugin API version (``KVCORE_API_VERSION``) fails before any of its
        hooks is registered."""
        problem = version_problem(name, plugin)
        if problem is not None:
            self._fail(name, "version", problem)
            return False
        try:
            self.manager.register(plugin, name=name)
        except Exception as exc:  # pluggy validates signatures against the specs here
            self._fail(name, "hooks", f"{type(exc).__name__}: {exc}")
            return False
        try:
            self.manager.check_pending()
        except pluggy.PluginValidationError as exc:
            self.manager.unregister(name=name)
            self._fail(name, "hooks", f"implements a hook no spec defines (misspelt kvcore_ name?): {exc}")
            return False
        undecorated = sorted(
            attr
            for attr in dir(plugin)
            if attr.startswith("kvcore_")
            and callable(getattr(plugin, attr))
            and self.manager.parse_hookimpl_opts(plugin, attr) is None
        )
        if undecorated:
            self.manager.unregister(name=name)
            self._fail(
                name,
                "hooks",
                f"{', '.join(undecorated)} look(s) like hook implementations but lack @kvcore.hookimpl; "
                "decorate them (or rename them without the kvcore_ prefix)",
            )
            return False
        if not self._collect_backends(name):
            self.manager.unregister(name=name)
            return False
        self.plugins.append(name)
        self.api_versions[name] = getattr(plugin, VERSION_ATTRIBUTE, None)
        return True

    def _collect_backends(self, name: str) -> bool:
        plugin = self.manager.get_plugin(name)
        impls = [i for i in self.manager.hook.kvcore_register_backends.get_hookimpls() if i.plugin is plugin]
        found: list[BackendSpec] = []
        for impl in impls:
            try:
                result = impl.function()
                if isinstance(result, (Mapping, str, bytes)):
                    raise TypeError(f"returned a {type(result).__name__}, not an iterable of BackendSpec records")
                records = list(result or ())
            except Exception as exc:
                self._fail(name, "register", f"kvcore_register_backends raised {type(exc).__name__}: {exc}")
                return False
            for record in records:
                if not isinstance(record, BackendSpec):
                    self._fail(
                        name,
                        "register",
                        f"kvcore_register_backends returned {type(record).__name__} {record!r}; "
                        "expected kvcore.backend.BackendSpec records",
                    )
                    return False
                found.append(attrs.evolve(record, plugin=name))
        names = [r.name for r in found]
        for record in found:
            if names.count(record.name) > 1:
                self._fail(name, "register", f"registers backend {record.name!r} twice")
                return False
            owner = self._backends.get(record.name)
            if owner is not None:
                self._fail(
                    name,
                    "register",
                    f"backend {record.name!r} is already registered by plugin {owner.plugin!r}; "
                    f"disable one of them with KVCORE_DISABLE_PLUGINS={name} or ={owner.plugin}",
                )
                return False
        declared = {n: (t, b) for b in self._backends.values() for n, t in b.model_sections.items()}
        for record in found:
            for section, schema in record.model_sections.items():
                other = declared.get(section)
                if other is not None and other[0] is not schema:
                    self._fail(
                        name,
                        "register",
                        f"backend {record.name!r} declares model section {section!r} as {schema.__qualname__}, but "
                        f"backend {other[1].name!r} (plugin {other[1].plugin!r}) declares it as {other[0].__qualname__}; "
                        "a section has one schema: import the declaring plugin's class",
                    )
                    return False
                declared[section] = (schema, record)
        for record in found:
            self._backends[record.name] = record
        return True


def load_registry(
    *,
    entry_points: Iterable[metadata.EntryPoint] | None = None,
    env: Mapping[str, str] | None = None,
    extra_plugins: Iterable[tuple[str, Any]] = (),
) -> Registry:
    """Build a fresh registry: core defaults, then entry points (filtered by the env switches), then extras.

    :param entry_points: the entry points to consider (default: the installed ``kvcore`` group).
    :param env: environment to read the switches from (default: ``os.environ``).
    :param extra_plugins: ``(name, plugin)`` pairs registered after the entry points (engines, tests).
    """
    env = os.environ if env is None else env
    allow = _names(env.get("KVCORE_PLUGINS"))
    block = _names(env.get("KVCORE_DISABLE_PLUGINS")) or set()
    strict = env.get("KVCORE_STRICT_PLUGINS", "0") not in ("", "0")

    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    manager.register(builtin, name=CORE_PLUGIN_NAME)
    registry = Registry(manager=manager, strict=strict)

    if entry_points is None:
        entry_points = metadata.entry_points(group=ENTRY_POINT_GROUP)
    entry_points = list(entry_points)
    for ep in sorted(entry_points, key=lambda e: e.name):
        if allow is not None and ep.name not in allow:
            registry.skipped[ep.name] = "not in KVCORE_PLUGINS"
            continue
        if ep.name in block:
            registry.skipped[ep.name] = "in KVCORE_DISABLE_PLUGINS"
            continue
        try:
            plugin = ep.load()
        except Exception as exc:
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            registry._fail(ep.name, "import", f"cannot import {ep.value!r}: {last}")
            continue
        registry.register(plugin, ep.name)
    for name in sorted((allow or set()) - {ep.name for ep in entry_points}):
        registry.skipped[name] = "named in KVCORE_PLUGINS but not installed"
        logger.warning("KVCORE_PLUGINS names %r, but no such kvcore plugin is installed", name)
    for name, plugin in extra_plugins:
        registry.register(plugin, name)
    return registry


_REGISTRY: Registry | None = None


def get_registry(*, reload: bool = False) -> Registry:
    """The process-wide registry, loaded on first use."""
    global _REGISTRY
    if _REGISTRY is None or reload:
        _REGISTRY = load_registry()
    return _REGISTRY
