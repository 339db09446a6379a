"""The publish check: a policy or guard model version is measured before the admin API publishes it.

What is measured: the cascade the version defines, with early exit as in service, on the test split of the
labelled set and the red-team probes built from it (`guard.redteam`, `guard.figures`). A policy version is
measured as it is. A guard model version is measured inside every policy whose alias's main target runs a
version of the same guard name, with that stage swapped to the new version; a guard name no aliased policy
uses is published unmeasured (nothing it replaces is served).

What it is compared with, "the version it replaces": the version the name's alias serves (its target with
the largest weight, the first on a tie: the stable side of a canary); with no alias, the name's newest
version; for a guard model version, the policy as it is. A name with neither is published with its figures
and compared with nothing. The baseline's figures are read from the registry when it holds them for this
suite, else measured now and recorded, so both sides are always measured on the same items.

Refused (409, the figures in the body) when a gated figure regresses past `[guard] publish_tolerance_*`,
or when the figures cannot be computed (a guard not loadable, an item ending in a guard error, the data
missing): a figure measured on fewer items than the baseline's is not comparable. An `operator` key of the
operating organisation may force either; the record keeps `forced` and the key.

Scoring runs one item at a time on the event loop's guards (engine calls are awaited; rules stages go to the
renderer's executor for long items) and yields between items; the set loads once, in a thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

import msgspec

from gateway.config import GuardConfig
from gateway.errors import APIError, ErrorBody
from gateway.guard_factory import GuardFactory, LoadingGuard
from guard.base import Classifier
from guard.cascade import Stage
from guard.figures import Figures, Regression, Suite, Tolerance, measure, regressions
from guard.labelled import load_items
from guard.redteam import load_templates, probes, spread
from policy.safety.gate import build_cascade
from registry.errors import RegistryError
from registry.hashing import canonical_json, content_hash
from registry.models import FiguresRecord, GuardModelSpec, Kind, PolicySpec, Published, Spec
from registry.service import Registry
from registry.view import RegistryView, ResolvedGuard, ResolvedPolicy

log = logging.getLogger("lockgate.publish_check")

_DATA = Path(__file__).resolve().parent.parent / "ops" / "eval" / "data"
DEFAULT_DATA = _DATA / "guard"
DEFAULT_TEMPLATES = _DATA / "redteam" / "templates.jsonl"
_FIGURES = msgspec.json.Decoder(Figures)


class Report(msgspec.Struct, frozen=True, kw_only=True):
    """One measurement of a version against what it replaces."""

    ref: str  # the version published
    context: str = ""  # the policy a guard model version was measured in
    baseline: str = ""  # the version compared with ("" none)
    figures: Figures | None = None
    baseline_figures: Figures | None = None
    regressions: tuple[Regression, ...] = ()
    tolerance: Tolerance
    error: str = ""  # why the figures could not be computed or compared

    @property
    def refused(self) -> bool:
        """Whether this report alone refuses the publish."""
        return bool(self.error or self.regressions)


class RefusalBody(ErrorBody, frozen=True, kw_only=True):
    """The OpenAI error object, with the measurements that refused the publish."""

    reports: tuple[Report, ...]


class RefusalResponse(msgspec.Struct, frozen=True, kw_only=True):
    """`{"error": {...}}` of a refused publish."""

    error: RefusalBody


class PublishRefusedError(APIError):
    """409: the version regresses, or could not be measured; `force: true` (operator) overrides."""

    status_code = 409
    error_type = "conflict_error"
    default_code = "publish_refused"

    def __init__(self, reports: tuple[Report, ...]) -> None:
        refused = [r for r in reports if r.refused]
        unmeasured = [r for r in refused if r.error]
        if unmeasured:
            first = unmeasured[0]
            code = "publish_unmeasured"
            message = f"{first.ref} could not be measured ({first.error}); an operator may force it"
        else:
            first = refused[0]
            code = "publish_regression"
            worse = ", ".join(
                f"{g.figure} {g.baseline:.3f} -> {g.candidate:.3f} (tolerance {g.tolerance:g})"
                for g in first.regressions
            )
            within = f" in {first.context}" if first.context else ""
            message = f"{first.ref}{within} regresses against {first.baseline}: {worse}"
        super().__init__(message, param="force", code=code)
        self.reports = reports

    def body(self) -> RefusalResponse:  # type: ignore[override]
        """The error object with `reports`."""
        return RefusalResponse(
            error=RefusalBody(
                message=self.message,
                type=self.error_type,
                param=self.param,
                code=self.code,
                reports=self.reports,
            )
        )


def load_suite(config: GuardConfig) -> Suite:
    """The configured suite (blocking: run it in a thread)."""
    data = Path(config.publish_eval_data).expanduser() if config.publish_eval_data else DEFAULT_DATA
    path = config.publish_eval_templates
    templates = load_templates(Path(path).expanduser() if path else DEFAULT_TEMPLATES)
    items = sorted((i for i in load_items(data) if i.split == "test"), key=lambda i: i.id)
    kinds = sorted({i.kind for i in items})
    limited = [x for k in kinds for x in spread([i for i in items if i.kind == k], config.publish_eval_limit)]
    return Suite.of(limited, probes(items, templates, limit=config.publish_eval_limit))


def _main_target(view: RegistryView, kind: Kind, name: str) -> Published | None:
    """The version `name` serves now: its alias's heaviest target, else its newest version."""
    if view.has_alias(kind, name):
        targets = view.alias(kind, name).targets
        best = max(targets, key=lambda t: t.weight)  # max keeps the first of equal weights
        return view.get(kind, name, best.version)
    versions = view.versions(kind, name)
    return versions[-1] if versions else None


def _unpublished(kind: Kind, name: str, version: str, spec: Spec) -> Published:
    spec_json = canonical_json(spec)
    return Published(
        kind=kind,
        name=name,
        version=version,
        content_hash=content_hash(spec_json),
        spec_json=spec_json,
        published_at=0.0,
        actor="",
    )


class PublishCheck:
    """Measures versions before they are published, and records their figures."""

    def __init__(
        self,
        *,
        registry: Registry,
        guards: GuardFactory,
        config: GuardConfig,
        clock: Callable[[], float],
        executor: Executor | None = None,
        suite: Callable[[], Suite] | None = None,
    ) -> None:
        """`suite` loads the evaluation suite (blocking; default: `load_suite(config)`), once."""
        self._registry = registry
        self._guards = guards
        self._executor = executor
        self._clock = clock
        self._load = suite or (lambda: load_suite(config))
        self._suite: Suite | None = None
        self._lock = asyncio.Lock()
        self.tolerance = Tolerance(recall=config.publish_tolerance_recall, fpr=config.publish_tolerance_fpr)

    async def suite(self) -> Suite:
        """The evaluation suite, loaded on first use (in a thread)."""
        async with self._lock:
            if self._suite is None:
                self._suite = await asyncio.to_thread(self._load)
            return self._suite

    async def measure(self, kind: Kind, name: str, version: str, spec: Spec) -> tuple[Report, ...]:
        """The reports of publishing `spec` as `name@version` (none: nothing to measure, or the version
        exists already and the registry answers for it)."""
        view = self._registry.view
        if kind not in ("policy", "guard_model") or view.has(kind, name, version):
            return ()
        ref = f"{name}@{version}"
        try:
            suite = await self.suite()
        except (OSError, ValueError) as exc:
            return (Report(ref=ref, tolerance=self.tolerance, error=f"evaluation set: {exc}"),)
        try:
            if isinstance(spec, PolicySpec):
                candidate = _resolved(view, _unpublished(kind, name, version, spec), spec)
                baseline = _main_target(view, kind, name)
                return (await self._compare(view, suite, ref, candidate, {}, baseline, ""),)
            if isinstance(spec, GuardModelSpec):
                return await self._guard(view, suite, _unpublished(kind, name, version, spec), spec)
        except RegistryError:
            # The spec refers to versions that do not exist: the registry's own checks refuse it (400).
            return ()
        return ()

    async def _guard(
        self, view: RegistryView, suite: Suite, guard: Published, spec: GuardModelSpec
    ) -> tuple[Report, ...]:
        model = view.resolve_model(spec.model, key="") if spec.kind == "one_token" else None
        new = ResolvedGuard(ref=guard.ref, guard=guard, spec=spec, model=model)
        reports: list[Report] = []
        built = self._guards.build(new)
        try:
            for alias in view.aliases("policy"):
                policy = _main_target(view, "policy", alias.name)
                if policy is None:
                    continue
                current = view.resolve_policy(policy.ref, key="")
                swapped = tuple(new if g.guard.name == guard.name else g for g in current.guards)
                if swapped == current.guards:
                    continue
                candidate = _swap(current, guard.name, guard.ref, swapped)
                overrides = {guard.ref: built}
                reports.append(
                    await self._compare(view, suite, guard.ref, candidate, overrides, policy, policy.ref)
                )
        finally:
            if isinstance(built, LoadingGuard):
                built.cancel()
        return tuple(reports)

    async def _compare(
        self,
        view: RegistryView,
        suite: Suite,
        ref: str,
        candidate: ResolvedPolicy,
        overrides: dict[str, Classifier],
        baseline: Published | None,
        context: str,
    ) -> Report:
        figures, error = await self._measure(candidate, overrides, suite)
        report = Report(ref=ref, context=context, figures=figures, tolerance=self.tolerance, error=error)
        if baseline is None or error:
            return report
        report = msgspec.structs.replace(report, baseline=baseline.ref)
        before, error = await self._baseline(view, baseline, suite)
        if before is None or figures is None:
            return msgspec.structs.replace(report, error=f"baseline {baseline.ref}: {error}")
        found = regressions(figures, before, self.tolerance)
        return msgspec.structs.replace(report, baseline_figures=before, regressions=found)

    async def _baseline(
        self, view: RegistryView, baseline: Published, suite: Suite
    ) -> tuple[Figures | None, str]:
        """The stored figures of the policy `baseline` on `suite`, or measured now (and recorded)."""
        for record in await self._registry.store.figures("policy", baseline.name):
            stored = (record.version, record.suite_sha256, record.context)
            # A record with an error (a forced publish) is no baseline: it is measured again.
            if stored == (baseline.version, suite.sha256, "") and record.figures and not record.error:
                return _FIGURES.decode(record.figures), ""
        policy = view.resolve_policy(baseline.ref, key="")
        figures, error = await self._measure(policy, {}, suite)
        if figures is not None:
            await self._registry.store.record_figures(
                _record(baseline, "", figures, actor="publish-check", now=self._clock())
            )
        return figures, error

    async def _measure(
        self, policy: ResolvedPolicy, overrides: dict[str, Classifier], suite: Suite
    ) -> tuple[Figures | None, str]:
        """The figures of `policy`'s cascade, or None and why they cannot be trusted."""

        def classifier(guard: ResolvedGuard) -> Classifier:
            return overrides.get(guard.ref) or self._guards(guard)

        cascade = build_cascade(policy, classifier, executor=self._executor)
        for stage in cascade.stages:
            if isinstance(stage, Stage) and isinstance(stage.classifier, LoadingGuard):
                try:
                    await stage.classifier.ready()
                except Exception as exc:  # a guard that cannot load: the publish is refused, not crashed
                    return None, f"guard {stage.classifier.name} does not load: {exc!r}"
        figures = await measure(cascade, suite)
        if figures.errors:
            return figures, f"{figures.errors} item(s) ended in a guard error, e.g. {figures.first_error}"
        return figures, ""

    async def record(self, published: Published, reports: tuple[Report, ...], *, forced: bool) -> None:
        """Keep the figures of a version just published (and, forced, why it was refused)."""
        for report in reports:
            await self._registry.store.record_figures(
                _record(
                    published,
                    report.context,
                    report.figures,
                    actor=published.actor,
                    now=self._clock(),
                    baseline=report.baseline,
                    error=report.error,
                    forced=forced and report.refused,
                    suite=self._suite.sha256 if self._suite is not None else "",
                )
            )
            if forced and report.refused:
                log.warning(
                    "%s published by %s past a refused publish check: %s",
                    published.ref,
                    published.actor,
                    report.error or report.regressions,
                )


def _record(
    version: Published,
    context: str,
    figures: Figures | None,
    *,
    actor: str,
    now: float,
    baseline: str = "",
    error: str = "",
    forced: bool = False,
    suite: str = "",
) -> FiguresRecord:
    return FiguresRecord(
        kind=version.kind,
        name=version.name,
        version=version.version,
        suite_sha256=figures.suite_sha256 if figures is not None else suite,
        context=context,
        figures=msgspec.json.encode(figures).decode() if figures is not None else "",
        error=error,
        baseline=baseline,
        forced=forced,
        at=now,
        actor=actor,
    )


def _resolved(view: RegistryView, policy: Published, spec: PolicySpec) -> ResolvedPolicy:
    """An unpublished policy version with its (published) guards resolved in `view`."""
    guards = tuple(view.resolve_guard(s.guard, key="") for s in spec.stages if s.kind == "model")
    return ResolvedPolicy(ref=policy.ref, policy=policy, spec=spec, guards=guards, generation=view.generation)


def _swap(policy: ResolvedPolicy, name: str, ref: str, guards: tuple[ResolvedGuard, ...]) -> ResolvedPolicy:
    """`policy` with the stages of guard `name` on version `ref` instead."""
    stages = tuple(
        msgspec.structs.replace(s, guard=ref) if s.kind == "model" and s.guard.split("@")[0] == name else s
        for s in policy.spec.stages
    )
    spec = msgspec.structs.replace(policy.spec, stages=stages)
    return msgspec.structs.replace(policy, spec=spec, guards=guards)
