"""Render the Helm chart in-process (helm-python-sdk: Helm's Go SDK, no binary, no cluster)
and look into what it renders.

Everything here is offline: ``lookup`` returns nothing, so the chart behaves as on a
first install.
"""

from __future__ import annotations

import ast
import base64
import copy
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "handoff"
YAMLLINT_CONFIG = REPO_ROOT / "helm" / ".yamllint"
METRICS_MODULES = (
    REPO_ROOT / "lb" / "metrics.py",
    REPO_ROOT / "node_sidecar" / "metrics.py",
    REPO_ROOT / "node_engine" / "metrics.py",
)

RELEASE = "rel"
NAMESPACE = "rl-prod"
ROLES = ("mixed", "prefill", "decode")

Obj = dict[str, Any]


@dataclass(frozen=True)
class Manifest:
    """One rendered Kubernetes object and the template it came from."""

    source: str
    obj: Obj

    @property
    def kind(self) -> str:
        return str(self.obj["kind"])

    @property
    def name(self) -> str:
        return str(self.obj["metadata"]["name"])

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.obj["metadata"].get("labels") or {})


@dataclass
class Rendered:
    """A whole render: the objects, the raw YAML text per template, and NOTES.txt."""

    values: Obj
    merged: Obj
    manifests: list[Manifest]
    texts: dict[str, str]
    notes: str
    namespace: str = NAMESPACE
    release: str = RELEASE
    _by_kind: dict[str, list[Manifest]] = field(default_factory=dict)

    def of_kind(self, kind: str) -> list[Manifest]:
        if kind not in self._by_kind:
            self._by_kind[kind] = [m for m in self.manifests if m.kind == kind]
        return self._by_kind[kind]

    def one(self, kind: str, name: str) -> Manifest:
        found = [m for m in self.of_kind(kind) if m.name == name]
        assert len(found) == 1, f"expected one {kind}/{name}, found {[m.name for m in self.of_kind(kind)]}"
        return found[0]

    @property
    def all_text(self) -> str:
        """Everything the render produced, NOTES.txt included."""
        return "\n".join([*self.texts.values(), self.notes])

    @property
    def enabled_roles(self) -> list[str]:
        return [r for r in ROLES if self.merged["roles"][r]["enabled"]]


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> Obj:
    """``override`` merged into a copy of ``base`` (dicts recursively, the rest replaced)."""
    out: Obj = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def render(values: Obj, *, release: str = RELEASE, namespace: str = NAMESPACE) -> Rendered:
    """Render the chart with ``values``; raises the SDK's HelmError when it refuses them."""
    with helm.Chart.load(CHART_DIR) as chart:
        merged = chart.merge_values(values)
        out = chart.render(values, name=release, namespace=namespace, is_install=True)
    manifests: list[Manifest] = []
    texts: dict[str, str] = {}
    notes = ""
    for source, text in sorted(out.items()):
        if source.endswith("NOTES.txt"):
            notes = text
            continue
        if not text.strip():
            continue
        texts[source] = text
        for obj in yaml.safe_load_all(text):
            if obj:
                manifests.append(Manifest(source=source, obj=obj))
    return Rendered(values=values, merged=merged, manifests=manifests, texts=texts, notes=notes,
                    namespace=namespace, release=release)


_SEPARATOR = re.compile(r"(?:^|\n)---\s*\n")


def template_output(rendered: Rendered) -> str:
    """What ``helm template`` prints: each document trimmed, after ``---`` and its source."""
    out = []
    for source, text in rendered.texts.items():
        for doc in _SEPARATOR.split(text):
            if doc.strip():
                out.append(f"---\n# Source: {source}\n{doc.strip()}\n")
    return "".join(out)


def lint(values: Obj, *, kube_version: str) -> dict[str, Any]:
    """``helm lint --strict`` of the chart directory with ``values``."""
    return helm.lint(CHART_DIR, values, strict=True, namespace=NAMESPACE, kube_version=kube_version)


# ---- pods and containers ----

def pod_spec(workload: Manifest) -> Obj:
    return dict(workload.obj["spec"]["template"]["spec"])


def pod_labels(workload: Manifest) -> dict[str, str]:
    return dict(workload.obj["spec"]["template"]["metadata"]["labels"])


def container(workload: Manifest, name: str) -> Obj:
    found = [c for c in pod_spec(workload)["containers"] if c["name"] == name]
    assert len(found) == 1, f"{workload.kind}/{workload.name} has no single container {name!r}"
    return dict(found[0])


def flag_values(args: list[str], flag: str) -> list[str]:
    """Every value given to ``flag`` in an argv list (``--flag V`` or ``--flag=V``)."""
    values: list[str] = []
    for i, arg in enumerate(args):
        if arg == flag:
            assert i + 1 < len(args), f"{flag} is the last argument and has no value"
            values.append(args[i + 1])
        elif arg.startswith(flag + "="):
            values.append(arg.split("=", 1)[1])
    return values


def flag_value(args: list[str], flag: str) -> str:
    values = flag_values(args, flag)
    assert len(values) == 1, f"expected {flag} once in {args}, found {values}"
    return values[0]


def env_entries(c: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in c.get("env") or []}


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Whether an equality selector matches a label set."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def resolve_port(c: Obj, port: int | str) -> int:
    """A probe's port, by number or by the container port's name."""
    if isinstance(port, int):
        return port
    named = [p["containerPort"] for p in c.get("ports") or [] if p.get("name") == port]
    assert named, f"container {c['name']} has no port named {port!r}"
    return int(named[0])


_QUANTITY_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60, "m": 1e-3,
                   "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}


def quantity_bytes(quantity: str | int | float) -> int:
    """A Kubernetes quantity of the forms values.schema.json takes (``1Gi``, ``3G``, ``1e9``, a number) in bytes."""
    text = str(quantity)
    match = re.fullmatch(r"([0-9.eE+]+?)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?", text)
    assert match, f"not a quantity: {text!r}"
    return int(float(match.group(1)) * _QUANTITY_UNITS.get(match.group(2) or "", 1))


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


# ---- metrics ----

_METRIC_TYPES = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum", "CounterReadAtScrape"}


def declared_metrics(paths: tuple[Path, ...] = METRICS_MODULES) -> dict[str, str]:
    """``name -> type`` for every prometheus_client metric built in the given modules."""
    declared: dict[str, str] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            kind = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if kind not in _METRIC_TYPES:
                continue
            name_node = node.args[0] if node.args else next(
                (kw.value for kw in node.keywords if kw.arg == "name"), None)
            assert isinstance(name_node, ast.Constant) and isinstance(name_node.value, str), (
                f"{path}:{node.lineno}: a {kind} whose name is not a string literal")
            declared[name_node.value] = "Counter" if kind == "CounterReadAtScrape" else kind
    return declared


def exported_series(declared: Mapping[str, str]) -> set[str]:
    """The sample names prometheus_client exposes for the declared metrics."""
    names: set[str] = set()
    for name, kind in declared.items():
        if kind == "Counter":
            base = name[: -len("_total")] if name.endswith("_total") else name
            names |= {f"{base}_total", f"{base}_created"}
        elif kind == "Histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"}
        elif kind == "Summary":
            names |= {name, f"{name}_sum", f"{name}_count", f"{name}_created"}
        elif kind == "Info":
            names.add(f"{name}_info")
        else:
            names.add(name)
    return names


_METRIC_RE = re.compile(r"\bhandoff_[a-zA-Z0-9_:]+")


def dashboard_queries(node: Any) -> Iterator[str]:
    """Every PromQL string of a Grafana dashboard: panel targets and template variables."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition", "query") and isinstance(value, str):
                yield value
            else:
                yield from dashboard_queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from dashboard_queries(item)


def queried_metrics(dashboard: Obj) -> set[str]:
    return {m for q in dashboard_queries(dashboard) for m in _METRIC_RE.findall(q)}


def dashboard_from(rendered: Rendered) -> Obj:
    """The dashboard JSON as it ends up in the rendered ConfigMap."""
    maps = [m for m in rendered.of_kind("ConfigMap") if "handoff.json" in (m.obj.get("data") or {})]
    assert len(maps) == 1, "expected one ConfigMap holding handoff.json"
    dashboard: Obj = json.loads(maps[0].obj["data"]["handoff.json"])
    return dashboard


def panels(dashboard: Obj) -> Iterator[Obj]:
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])
