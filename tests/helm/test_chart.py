"""The Helm chart ``helm/handoff``, checked without a cluster (issue 7, SPEC section 8).

The chart is rendered in-process by Helm's Go SDK (helm-python-sdk) once per value set;
every object is validated against the Kubernetes OpenAPI schemas (kubernetes-validate,
strict), and the invariants the deployment depends on are checked on the objects.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from jsonschema import Draft202012Validator
from yamllint import linter
from yamllint.config import YamlLintConfig

from lb.__main__ import build_parser as build_lb_parser
from node_engine.__main__ import build_parser as build_engine_parser
from node_sidecar.__main__ import build_parser as build_sidecar_parser
from tests.helm.chart import (
    CHART_DIR,
    METRICS_MODULES,
    RELEASE,
    ROLES,
    YAMLLINT_CONFIG,
    Manifest,
    Obj,
    Rendered,
    b64,
    container,
    dashboard_from,
    declared_metrics,
    deep_merge,
    env_entries,
    exported_series,
    flag_value,
    flag_values,
    lint,
    panels,
    pod_labels,
    pod_spec,
    quantity_bytes,
    queried_metrics,
    render,
    resolve_port,
    selects,
    template_output,
)

# Tokens set in the values of every set that does not use an existing Secret: none of them
# may appear in plain text anywhere in what the chart renders.
ADMIN_TOKEN = "adm-Zq8v3N1kX7pW2mR9tL4cY6bH0sJ5gD"
API_KEY = "key-Hn4Tq7Wz1Lp9Vx3Rk6Bm2Cy8Fs5Gd0J"
TOKENS: Obj = {"auth": {"adminToken": ADMIN_TOKEN, "apiKey": API_KEY}}

VALUE_SETS: dict[str, Obj] = {
    # The chart's defaults, untouched (tokens generated).
    "default": {},
    # Defaults with tokens given.
    "tokens": TOKENS,
    # A prefill/decode split, no mixed nodes.
    "pd": deep_merge(TOKENS, {"roles": {
        "mixed": {"enabled": False},
        "prefill": {"enabled": True, "replicas": 2, "engineExtraArgs": ["--seed", "7"]},
        "decode": {"enabled": True, "replicas": 3, "nodeSelector": {"pool": "decode-gpus"}},
    }}),
    # Many mixed nodes on CPU, every optional engine and sidecar flag, another cluster domain, IPv6.
    "mixed": deep_merge(TOKENS, {
        "clusterDomain": "k8s.internal",
        "listenAddress": "::",
        "logFormat": "text",
        "lb": {"replicas": 1, "policy": "power_of_two", "discoverInterval": 2.5, "controlTimeout": 90,
               "maxControlTimeout": 1800},
        "roles": {"mixed": {"replicas": 4}},
        "node": {
            "engine": {"device": "cpu", "weightsBackup": "disk", "backupSizeLimit": "20Gi",
                       "maxTotalTokens": 1048576, "maxBatchTokens": 8192, "dtype": "float32",
                       "livenessProbe": {"enabled": False}},
            "sidecar": {"holdRequests": True, "holdMax": 64, "holdTimeout": 30.5, "drainTimeout": 45},
        },
    }),
    # Tokens from a Secret that already exists, under other keys.
    "existing-secret": {"auth": {"existingSecret": "rl-tokens", "adminTokenKey": "admin", "apiKeyKey": "key"}},
    # ServiceMonitor and dashboard on, every role at once.
    "monitoring": deep_merge(TOKENS, {
        "roles": {"prefill": {"enabled": True}, "decode": {"enabled": True}},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
                    "dashboard": {"enabled": True}},
    }),
    # The model on a claim the chart creates.
    "volume-pvc": deep_merge(TOKENS, {"model": {
        "path": "/models/Qwen2.5-7B-Instruct",
        "volume": {"type": "pvc", "pvc": {"size": "200Gi", "storageClassName": "fast-rwx"}},
    }}),
    # The model on a directory of the Kubernetes node.
    "volume-hostpath": deep_merge(TOKENS, {"model": {
        "path": "/models/llama-3-8b",
        "volume": {"type": "hostPath", "hostPath": {"path": "/mnt/nvme/models"}},
    }}),
    # The model on a claim that already exists, mounted elsewhere, writable.
    "volume-existing-claim": deep_merge(TOKENS, {"model": {
        "path": "/checkpoints/step-0",
        "mountPath": "/checkpoints",
        "readOnly": False,
        "volume": {"type": "existingClaim", "existingClaim": {"claimName": "rl-checkpoints"}},
    }}),
    # NetworkPolicies with every peer list, Prometheus scraping, other ports.
    "network-policy": deep_merge(TOKENS, {
        "lb": {"port": 9000},
        "node": {"sidecar": {"port": 9090}, "engine": {"port": 31000}},
        "roles": {"prefill": {"enabled": True}, "decode": {"enabled": True}},
        "metrics": {"serviceMonitor": {"enabled": True}},
        "networkPolicy": {
            "enabled": True,
            "clientsFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "rl-jobs"}}}],
            "metricsFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                             "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}],
            "trainerFrom": [{"podSelector": {"matchExpressions": [
                                {"key": "job-role", "operator": "In", "values": ["trainer"]}]}},
                            {"ipBlock": {"cidr": "10.8.0.0/16", "except": ["10.8.1.0/24"]}}],
            "weightSyncPorts": {"start": 40000, "end": 40999},
        },
    }),
}

# Kubernetes versions the objects are validated against: the chart's floor and the newest
# the validator knows.
KUBE_FLOOR = "1.29"
KUBE_VERSIONS = (KUBE_FLOOR, kubernetes_validate.utils.latest_version())


@pytest.fixture(scope="module", params=list(VALUE_SETS))
def rendered(request: pytest.FixtureRequest) -> Rendered:
    return render(VALUE_SETS[request.param])


@pytest.fixture(scope="module")
def monitoring() -> Rendered:
    return render(VALUE_SETS["monitoring"])


def _workloads(r: Rendered) -> list[Manifest]:
    return r.of_kind("Deployment") + r.of_kind("StatefulSet")


def _lb(r: Rendered) -> Manifest:
    (lb,) = r.of_kind("Deployment")
    return lb


def _role_of(m: Manifest) -> str:
    return m.labels["handoff/role"]


def _node_sets(r: Rendered) -> dict[str, Manifest]:
    return {_role_of(s): s for s in r.of_kind("StatefulSet")}


def _headless(r: Rendered) -> dict[str, Manifest]:
    return {_role_of(s): s for s in r.of_kind("Service") if s.obj["spec"].get("clusterIP") == "None"}


# ---- the chart itself ----

def test_chart_passes_helm_lint_strict() -> None:
    for values in (VALUE_SETS["default"], VALUE_SETS["pd"], VALUE_SETS["monitoring"], VALUE_SETS["network-policy"]):
        report = lint(values, kube_version=f"v{KUBE_FLOOR}.0")
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert report["total_charts_linted"] == 1
        assert not report["errors"] and not problems, (report["errors"], problems)
    # And it does look at the values: a bad one is an error.
    report = lint({"lb": {"replicas": -1}}, kube_version=f"v{KUBE_FLOOR}.0")
    assert any(m["severity"] == 3 and "/lb/replicas" in m["error"] for m in report["messages"])


def test_chart_yaml_files_pass_yamllint() -> None:
    config = YamlLintConfig(file=str(YAMLLINT_CONFIG))
    for path in (CHART_DIR / "Chart.yaml", CHART_DIR / "values.yaml", YAMLLINT_CONFIG):
        problems = list(linter.run(path.read_text(), config, str(path)))
        assert not problems, "\n".join(f"{path.name}:{p.line}:{p.column} {p.rule} {p.desc}" for p in problems)


def test_values_yaml_is_documented_line_by_line() -> None:
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    key = re.compile(r"^\s*([A-Za-z_][\w.-]*):")
    undocumented = []
    for i, line in enumerate(lines):
        if not key.match(line):
            continue
        above = lines[i - 1].strip() if i else ""
        if not above.startswith("#") and "#" not in line:
            undocumented.append(f"values.yaml:{i + 1}: {line.strip()}")
    assert not undocumented, "keys without a comment:\n" + "\n".join(undocumented)


def test_docs_values_table_names_every_key() -> None:
    """Found by review: docs/kubernetes.md's Values table ("values.yaml ... docs/kubernetes.md explains them by
    topic") left out whole groups (nameOverride, fullnameOverride, imagePullSecrets, serviceAccount,
    podSecurityContext, securityContext) and keys of the lb and node groups (resources, extraEnv, pod labels,
    annotations, tolerations, priority and runtime classes: "pod placement"). Each top-level key is a row or in the
    "top level" row, and each row names every key of its group (``name`` or ``name.*``)."""
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    text = ("\n" + (CHART_DIR.parents[1] / "docs" / "kubernetes.md").read_text()).split("\n## Values\n", 1)[1]
    rows = {}
    for line in text.split("\n\n", 2)[1].splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) >= 2 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = {part for n in re.findall(r"`([A-Za-z][\w.*]*)`", cells[1])
                                         for part in n.split(".")}
    top = {name for name in re.findall(r"`([A-Za-z]\w*)`", text.split("| top level |", 1)[1].split("\n", 1)[0])}
    problems = [f"{key}: no row and not in the top-level row" for key in values
                if key not in rows and key not in top and not any(r.startswith(key + ".") for r in rows)]
    roles = {key for role in values["roles"].values() for key in role}
    for group, named in rows.items():
        keys = roles if group.startswith("roles.") else set(_values_at(values, group))
        nested = {r.split(".", 1)[1].split(".")[0] for r in rows if r.startswith(group + ".")}
        problems += [f"{group}.{key}" for key in sorted(keys - named - nested)]
    assert not problems, "keys of values.yaml missing from docs/kubernetes.md's Values table: " + ", ".join(problems)


def _values_at(values: Obj, path: str) -> Obj:
    for part in path.split("."):
        values = values[part]
    return values


def test_default_values_match_the_schema_and_the_schema_is_closed() -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    # draft-07 keywords used here mean the same under the 2020-12 validator.
    Draft202012Validator(schema).validate(defaults)

    def open_objects(node: Any, path: str) -> list[str]:
        found: list[str] = []
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node and node.get("additionalProperties") is not False:
                found.append(path)
            for k, v in node.items():
                found += open_objects(v, f"{path}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                found += open_objects(v, f"{path}/{i}")
        return found

    assert not open_objects(schema, ""), "objects with properties must reject unknown keys"


@pytest.mark.parametrize(("values", "message"), [
    pytest.param({"roles": {"mixed": {"replicas": -1}}},
                 "at '/roles/mixed/replicas': minimum: got -1, want 0", id="negative-replicas"),
    pytest.param({"lb": {"replicas": -2}}, "at '/lb/replicas': minimum: got -2, want 0", id="negative-lb-replicas"),
    pytest.param({"roles": {"bogus": {"enabled": True, "replicas": 1}}},
                 "at '/roles': additional properties 'bogus' not allowed", id="unknown-role"),
    pytest.param({"lb": {"replicas": "two"}}, "at '/lb/replicas': got string, want integer", id="string-replicas"),
    pytest.param({"lb": {"controlTimeout": "60s"}},
                 "at '/lb/controlTimeout': got string, want number", id="string-timeout"),
    pytest.param({"node": {"engine": {"maxTotalTokens": "lots"}}},
                 "at '/node/engine/maxTotalTokens': got string, want integer", id="string-tokens"),
    pytest.param({"replicaCount": 3}, "additional properties 'replicaCount' not allowed", id="unknown-top-level"),
    pytest.param({"lb": {"policy": "fastest"}}, "at '/lb/policy': value must be one of", id="unknown-policy"),
    pytest.param({"node": {"engine": {"device": "tpu"}}},
                 "at '/node/engine/device': value must be one of 'cuda', 'cpu'", id="unknown-device"),
    pytest.param({"node": {"sidecar": {"port": 70000}}},
                 "at '/node/sidecar/port': maximum: got 70,000, want 65,535", id="port-range"),
    # The processes run as a non-root user with every capability dropped: a port under 1024 cannot be bound
    # (exit 2 "Permission denied" on runtimes that keep net.ipv4.ip_unprivileged_port_start at 1024).
    pytest.param({"lb": {"port": 80}}, "at '/lb/port': minimum: got 80, want 1,024", id="lb-privileged-port"),
    pytest.param({"node": {"sidecar": {"port": 443}}}, "at '/node/sidecar/port': minimum: got 443, want 1,024",
                 id="sidecar-privileged-port"),
    pytest.param({"node": {"engine": {"port": 1000}}}, "at '/node/engine/port': minimum: got 1,000, want 1,024",
                 id="engine-privileged-port"),
    # The LB and the sidecars refuse a token with a space, a blank one or non-ASCII at start (exit 2).
    pytest.param({"auth": {"adminToken": "my token"}}, "at '/auth/adminToken': 'my token' does not match pattern",
                 id="token-with-space"),
    pytest.param({"auth": {"apiKey": "   "}}, "at '/auth/apiKey': '   ' does not match pattern", id="blank-token"),
    pytest.param({"auth": {"apiKey": "clé"}}, "at '/auth/apiKey': 'clé' does not match pattern", id="non-ascii-token"),
    # The LB refuses a discovery name with an empty or over-long label at start (exit 2).
    pytest.param({"clusterDomain": "cluster..local"}, "at '/clusterDomain': 'cluster..local' does not match pattern",
                 id="domain-empty-label"),
    pytest.param({"clusterDomain": "a" * 64 + ".local"}, "at '/clusterDomain':", id="domain-long-label"),
    # A container's resource claim names a pod resourceClaims entry, which the chart has none of: the API server
    # refused the pod, or dropped the field where dynamic resource allocation is off.
    pytest.param({"node": {"engine": {"resources": {"claims": [{"name": "gpu"}]}}}},
                 "at '/node/engine/resources': additional properties 'claims' not allowed", id="resource-claims"),
    # The engine runs on one GPU: more would be reserved and idle.
    pytest.param({"node": {"engine": {"gpus": 2}}}, "at '/node/engine/gpus': maximum: got 2, want 1", id="gpus"),
    # A peer is a NetworkPolicyPeer, not a label set.
    pytest.param({"networkPolicy": {"trainerFrom": [{"app": "trainer"}]}},
                 "at '/networkPolicy/trainerFrom/0': additional properties 'app' not allowed", id="peer-as-labels"),
    pytest.param({"networkPolicy": {"metricsFrom": [{"ipBlock": {"except": ["10.0.0.0/8"]}}]}},
                 "at '/networkPolicy/metricsFrom/0/ipBlock': missing property 'cidr'", id="ipblock-no-cidr"),
    pytest.param({"networkPolicy": {"weightSyncPorts": {"start": 80, "end": 60999}}},
                 "at '/networkPolicy/weightSyncPorts/start': minimum: got 80, want 1,024", id="weight-sync-low-port"),
    # Found by review: every process refuses a number of seconds over a week (604800) at start (exit 2); the
    # schema took any number above 0, and the pods crash-looped.
    pytest.param({"lb": {"maxControlTimeout": 700000}},
                 "at '/lb/maxControlTimeout': maximum: got 700,000, want 604,800", id="seconds-over-a-week-lb"),
    pytest.param({"lb": {"discoverInterval": 604800.5}},
                 "at '/lb/discoverInterval': maximum: got 604,800.5, want 604,800", id="seconds-over-a-week-discovery"),
    pytest.param({"node": {"sidecar": {"holdTimeout": 700000}}},
                 "at '/node/sidecar/holdTimeout': maximum: got 700,000, want 604,800", id="seconds-over-a-week-hold"),
])
def test_schema_rejects_bad_values_with_a_clear_message(values: Obj, message: str) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        render(values)
    assert message in str(caught.value)
    assert "values don't meet the specifications of the schema" in str(caught.value)


@pytest.mark.parametrize(("values", "message"), [
    pytest.param({"roles": {"mixed": {"enabled": False}}}, "no node role is enabled", id="no-role"),
    pytest.param({"roles": {"prefill": {"enabled": True}}},
                 "roles.prefill and roles.decode must be enabled together", id="prefill-without-decode"),
    pytest.param({"model": {"path": "/models/x", "volume": {"type": "hostPath"}}},
                 "model.volume.hostPath.path must be set when model.volume.type is hostPath", id="hostpath-no-path"),
    pytest.param({"model": {"path": "/models/x", "volume": {"type": "existingClaim"}}},
                 "model.volume.existingClaim.claimName must be set", id="claim-no-name"),
    pytest.param({"model": {"path": "/data/x", "volume": {"type": "pvc"}}},
                 'model.path "/data/x" is not under model.mountPath "/models"', id="path-outside-volume"),
    pytest.param({"node": {"engine": {"extraArgs": ["--host", "0.0.0.0"]}}},
                 "node.engine.extraArgs must not set --host", id="engine-host-override"),
    pytest.param({"roles": {"mixed": {"engineExtraArgs": ["--port=1234"]}}},
                 "roles.mixed.engineExtraArgs must not set --port=1234", id="engine-port-override"),
    pytest.param({"auth": {"apiKeyKey": "admin-token"}}, "auth.adminTokenKey and auth.apiKeyKey must differ",
                 id="same-secret-keys"),
    pytest.param({"lb": {"maxControlTimeout": 300}}, "lb.weightSyncTimeout (600) must not exceed lb.maxControlTimeout",
                 id="weight-sync-over-max"),
    pytest.param({"lb": {"controlTimeout": 5000}}, "lb.controlTimeout (5000) must not exceed lb.maxControlTimeout",
                 id="control-over-max"),
    pytest.param({"node": {"sidecar": {"drainTimeout": 4000}},
                  "lb": {"controlTimeout": 5000, "maxControlTimeout": 9000}},
                 "node.sidecar.drainTimeout (4000) must be at most 3600", id="drain-over-sidecar-max"),
    pytest.param({"node": {"sidecar": {"drainTimeout": 200}, "terminationGracePeriodSeconds": 300}},
                 "must be shorter than lb.controlTimeout", id="drain-over-control"),
    pytest.param({"node": {"terminationGracePeriodSeconds": 30}},
                 "node.terminationGracePeriodSeconds (30) must exceed node.sidecar.drainTimeout",
                 id="grace-under-drain"),
    pytest.param({"node": {"engine": {"port": 8080}}}, "node.engine.port and node.sidecar.port must differ",
                 id="same-ports"),
    pytest.param({"node": {"engine": {"maxTotalTokens": 1}}},
                 "node.engine.maxTotalTokens must be 0 (the engine's default) or at least 2", id="one-kv-token"),
    pytest.param({"lb": {"replicas": 2, "pdb": {"minAvailable": 2}}},
                 "lb.pdb.minAvailable (2) must be below lb.replicas (2)", id="lb-pdb-blocks-drains"),
    # Raised alone, the weight calls' bound outlasted a stopping LB's: the LB cut a weight call the nodes still ran.
    pytest.param({"lb": {"weightSyncTimeout": 1800, "maxControlTimeout": 3600}},
                 "lb.shutdownTimeout (690) must not be below the LB's --weight-sync-timeout (1890",
                 id="weight-call-outlasts-lb-stop"),
    # Found by review: the LB's own weight bound is lb.weightSyncTimeout + 90; at 600 the default shutdown cut it.
    pytest.param({"lb": {"shutdownTimeout": 600, "terminationGracePeriodSeconds": 630}},
                 "lb.shutdownTimeout (600) must not be below the LB's --weight-sync-timeout (690",
                 id="lb-stop-under-its-weight-bound"),
    pytest.param({"lb": {"shutdownTimeout": 700, "terminationGracePeriodSeconds": 700}},
                 "lb.terminationGracePeriodSeconds (700) must exceed lb.shutdownTimeout (700) plus the 5 s preStop",
                 id="lb-grace-under-shutdown"),
    pytest.param({"lb": {"extraArgs": ["--admin-token", "s3cret"]}}, "lb.extraArgs must not set --admin-token",
                 id="lb-token-flag"),
    pytest.param({"node": {"sidecar": {"extraArgs": ["--api-key=s3cret"]}}},
                 "node.sidecar.extraArgs must not set --api-key", id="sidecar-token-flag"),
    # argparse takes an unambiguous abbreviation for the flag: the same refusals.
    pytest.param({"lb": {"extraArgs": ["--admin-tok=s3cret"]}}, "lb.extraArgs must not set --admin-token",
                 id="lb-token-flag-abbreviated"),
    pytest.param({"node": {"sidecar": {"extraArgs": ["--api", "s3cret"]}}},
                 "node.sidecar.extraArgs must not set --api-key", id="sidecar-token-flag-abbreviated"),
    pytest.param({"node": {"engine": {"extraArgs": ["--hos", "0.0.0.0"]}}},
                 "node.engine.extraArgs must not set --hos", id="engine-host-override-abbreviated"),
    pytest.param({"clusterDomain": ".".join(["d" * 59] * 4)}, "over DNS's 253 (the LB would exit at start)",
                 id="discovery-name-too-long"),
    # A token variable in extra env is in the pod spec, or hides the Secret's (the last definition wins).
    pytest.param({"lb": {"extraEnv": [{"name": "HANDOFF_ADMIN_TOKEN", "value": "s3cret"}]}},
                 "lb.extraEnv must not set HANDOFF_ADMIN_TOKEN", id="lb-token-env"),
    pytest.param({"node": {"sidecar": {"extraEnv": [
        {"name": "HANDOFF_API_KEY", "valueFrom": {"secretKeyRef": {"name": "other", "key": "k"}}}]}}},
                 "node.sidecar.extraEnv must not set HANDOFF_API_KEY", id="sidecar-token-env"),
    pytest.param({"node": {"engine": {"extraEnv": [{"name": "HANDOFF_ADMIN_TOKEN", "value": "s3cret"}]}}},
                 "node.engine.extraEnv must not set HANDOFF_ADMIN_TOKEN", id="engine-token-env"),
    # Kubernetes refuses an empty peer, and an ipBlock beside a selector, only at install.
    pytest.param({"networkPolicy": {"enabled": True, "clientsFrom": [{}]}},
                 "networkPolicy.clientsFrom[0] names no peer", id="empty-peer"),
    pytest.param({"networkPolicy": {"enabled": True, "trainerFrom": [
        {"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}},
                 "networkPolicy.trainerFrom[0] mixes ipBlock with a selector", id="ipblock-and-selector"),
    pytest.param({"networkPolicy": {"enabled": True, "weightSyncPorts": {"start": 50000, "end": 40000}}},
                 "networkPolicy.weightSyncPorts.start (50000) must not exceed networkPolicy.weightSyncPorts.end",
                 id="weight-sync-range-reversed"),
    # The range is open to the trainer's pods: it must not open the engine's or the sidecar's port.
    pytest.param({"networkPolicy": {"enabled": True, "weightSyncPorts": {"start": 30000, "end": 60999}}},
                 "networkPolicy.weightSyncPorts (30000-60999) must not hold node.engine.port (30000)",
                 id="weight-sync-range-holds-engine-port"),
    pytest.param({"node": {"sidecar": {"port": 40000}}, "networkPolicy": {"enabled": True}},
                 "networkPolicy.weightSyncPorts (32768-60999) must not hold node.sidecar.port (40000)",
                 id="weight-sync-range-holds-sidecar-port"),
    pytest.param({"networkPolicy": {"enabled": True}, "metrics": {"serviceMonitor": {"enabled": True}}},
                 "networkPolicy.metricsFrom must name Prometheus' pods when metrics.serviceMonitor.enabled",
                 id="scrapes-blocked"),
    # The chart pins the node pods' ephemeral range to the weight-sync ports: a second value would hide one.
    pytest.param({"networkPolicy": {"enabled": True, "trainerFrom": [{"podSelector": {}}]},
                  "podSecurityContext": {"sysctls": [{"name": "net.ipv4.ip_local_port_range", "value": "1024 65535"}]}},
                 "podSecurityContext.sysctls must not set net.ipv4.ip_local_port_range", id="port-range-sysctl-twice"),
    # A backup on the node's disk with no size: nothing reserved, and no bound before the node's disk fills.
    pytest.param({"node": {"engine": {"weightsBackup": "disk"}}},
                 "node.engine.backupSizeLimit must be set (above 0) when the weights backup is written to disk",
                 id="disk-backup-without-size"),
    pytest.param({"node": {"engine": {"device": "cpu", "gpus": 0, "weightsBackup": "cpu"}}},
                 "node.engine.backupSizeLimit must be set (above 0) when the weights backup is written to disk",
                 id="cpu-engine-backup-without-size"),
    pytest.param({"node": {"engine": {"weightsBackup": "disk", "backupSizeLimit": "0Gi"}}},
                 "node.engine.backupSizeLimit must be set (above 0)", id="disk-backup-of-size-zero"),
    # Kubernetes refuses two volumes on one path; a backup inside the model's mount writes into its claim.
    pytest.param({"node": {"engine": {"weightsBackup": "disk", "backupSizeLimit": "1Gi", "backupDir": "/tmp/"}}},
                 "node.engine.backupDir (/tmp/) must not be /tmp", id="backup-on-tmp"),
    pytest.param({"node": {"engine": {"weightsBackup": "disk", "backupSizeLimit": "1Gi", "backupDir": "/dev/shm"}}},
                 "node.engine.backupDir (/dev/shm) must not be /dev/shm", id="backup-on-shm"),
    pytest.param({"model": {"path": "/x", "mountPath": "/", "volume": {"type": "pvc"}}},
                 "model.mountPath (/) must not be /", id="model-on-root"),
    pytest.param({"model": {"path": "/models/x", "volume": {"type": "pvc"}},
                  "node": {"engine": {"weightsBackup": "disk", "backupSizeLimit": "1Gi", "backupDir": "/models/bk"}}},
                 "node.engine.backupDir (/models/bk) and model.mountPath (/models) must not hold one another",
                 id="backup-in-model-mount"),
    # A CUDA engine given no GPU got NVIDIA_VISIBLE_DEVICES=void and exited at start, in a crash loop.
    pytest.param({"node": {"engine": {"gpus": 0}}},
                 "node.engine.device cuda with node.engine.gpus 0 gives the engine no GPU",
                 id="cuda-engine-without-gpu"),
    # The Prometheus Operator skips a ServiceMonitor whose timeout exceeds its interval: nothing was scraped.
    pytest.param({"metrics": {"serviceMonitor": {"enabled": True, "interval": "5s", "scrapeTimeout": "10s"}}},
                 "metrics.serviceMonitor.scrapeTimeout (10s) must not exceed metrics.serviceMonitor.interval (5s)",
                 id="scrape-timeout-over-interval"),
    # A token beside an existing Secret was dropped without a word: the processes used the Secret's.
    pytest.param(deep_merge(TOKENS, {"auth": {"existingSecret": "rl-tokens"}}),
                 "auth.adminToken and auth.apiKey must be empty with auth.existingSecret (rl-tokens)",
                 id="token-beside-existing-secret"),
    pytest.param({"auth": {"existingSecret": "rl-tokens", "apiKey": API_KEY}},
                 "auth.adminToken and auth.apiKey must be empty with auth.existingSecret",
                 id="key-beside-existing-secret"),
])
def test_template_rejects_inconsistent_values_with_a_clear_message(values: Obj, message: str) -> None:
    with pytest.raises(helm.HelmRenderError) as caught:
        render(values)
    assert message in str(caught.value)


# ---- every value set: Kubernetes validity ----

def _assert_valid_for_kubernetes(r: Rendered) -> None:
    unknown = []
    for m in r.manifests:
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(m.obj, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                unknown.append(m.kind)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                pytest.fail(f"{m.source}: {m.kind}/{m.name} invalid for Kubernetes {version}: {path}: {e.message}")
    # Only the Prometheus Operator's CRD has no schema in Kubernetes (checked separately).
    assert set(unknown) <= {"ServiceMonitor"}, unknown


def test_every_object_validates_against_kubernetes_strict(rendered: Rendered) -> None:
    _assert_valid_for_kubernetes(rendered)


def test_strict_validation_catches_an_unknown_field(rendered: Rendered) -> None:
    """Guard against a validator that accepts anything: break a rendered object on purpose."""
    broken = json.loads(json.dumps(_lb(rendered).obj))
    broken["spec"]["template"]["spec"]["containers"][0]["listenAddress"] = "0.0.0.0"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBE_VERSIONS[-1], strict=True)


def test_rendered_manifests_pass_yamllint(rendered: Rendered) -> None:
    # Rendered YAML mixes toYaml's sequence style with the templates'; long JSON lines
    # of the dashboard are fine. Duplicate keys, trailing spaces and bad indents are not.
    config = YamlLintConfig(f"extends: {YAMLLINT_CONFIG}\nrules:\n  line-length: disable\n"
                            "  indentation: {spaces: 2, indent-sequences: whatever}\n  comments-indentation: disable\n")
    text = template_output(rendered)
    problems = list(linter.run(text, config))
    lines = text.splitlines()
    assert not problems, "\n".join(f"{p.line}:{p.column} {p.rule} {p.desc}: {lines[p.line - 1]!r}" for p in problems)


def test_objects_have_unique_names_labels_and_the_release_namespace(rendered: Rendered) -> None:
    seen = set()
    for m in rendered.manifests:
        key = (m.kind, m.name)
        assert key not in seen, f"{m.kind}/{m.name} rendered twice"
        seen.add(key)
        assert m.obj["metadata"]["namespace"] == rendered.namespace
        for label in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/managed-by",
                      "helm.sh/chart"):
            assert m.labels.get(label), f"{m.kind}/{m.name} lacks label {label}"
        assert m.labels["app.kubernetes.io/instance"] == rendered.release


# ---- selectors, roles and discovery ----

def test_workload_selectors_match_their_pod_labels(rendered: Rendered) -> None:
    for w in _workloads(rendered):
        selector = w.obj["spec"]["selector"]["matchLabels"]
        assert selects(selector, pod_labels(w)), f"{w.kind}/{w.name}: {selector} vs {pod_labels(w)}"
        others = [o for o in _workloads(rendered) if o is not w]
        assert not any(selects(selector, pod_labels(o)) for o in others), f"{w.kind}/{w.name} selects others' pods"


def test_every_service_and_pdb_selects_exactly_one_workload(rendered: Rendered) -> None:
    for m in rendered.of_kind("Service") + rendered.of_kind("PodDisruptionBudget"):
        spec = m.obj["spec"]
        selector = spec["selector"] if m.kind == "Service" else spec["selector"]["matchLabels"]
        chosen = [w for w in _workloads(rendered) if selects(selector, pod_labels(w))]
        assert len(chosen) == 1, f"{m.kind}/{m.name} selects {[w.name for w in chosen]}"
        if m.kind == "Service":
            for port in spec["ports"]:
                target = port["targetPort"]
                named = [p for c in pod_spec(chosen[0])["containers"] for p in c.get("ports") or []
                         if p["name"] == target or p["containerPort"] == target]
                assert named, f"Service/{m.name} targets port {target!r} no container declares"


def test_one_statefulset_headless_service_and_pdb_per_enabled_role(rendered: Rendered) -> None:
    roles = rendered.enabled_roles
    sets, headless = _node_sets(rendered), _headless(rendered)
    assert sorted(sets) == sorted(roles) == sorted(headless)
    pdbs = {_role_of(p) for p in rendered.of_kind("PodDisruptionBudget") if "handoff/role" in p.labels}
    assert pdbs == set(roles)
    for role in roles:
        sts, svc = sets[role], headless[role]
        assert sts.obj["spec"]["replicas"] == rendered.merged["roles"][role]["replicas"]
        assert sts.obj["spec"]["serviceName"] == svc.name
        assert svc.obj["spec"]["publishNotReadyAddresses"] is True, "a released (not ready) node must stay discoverable"
        assert flag_value(container(sts, "sidecar")["args"], "--role") == role
    assert set(roles) <= set(ROLES)


def test_default_values_render_mixed_nodes_only() -> None:
    r = render({})
    assert r.enabled_roles == ["mixed"]
    assert list(_node_sets(r)) == ["mixed"]


def test_lb_discovers_exactly_the_headless_services(rendered: Rendered) -> None:
    args = container(_lb(rendered), "lb")["args"]
    domain = rendered.merged["clusterDomain"]
    expected = set()
    for role, svc in _headless(rendered).items():
        (port,) = svc.obj["spec"]["ports"]
        sidecar = container(_node_sets(rendered)[role], "sidecar")
        assert port["port"] == resolve_port(sidecar, port["targetPort"])
        expected.add(f"{role}={svc.name}.{rendered.namespace}.svc.{domain}:{port['port']}")
    assert set(flag_values(args, "--discover-dns")) == expected
    assert len(flag_values(args, "--discover-dns")) == len(expected)
    assert not flag_values(args, "--node") and not flag_values(args, "--prefill")


def test_lb_flags_follow_the_values(rendered: Rendered) -> None:
    lb_values = rendered.merged["lb"]
    lb = container(_lb(rendered), "lb")
    args = lb["args"]
    assert args[0] == "lb", "the image's entrypoint takes the process name first"
    assert flag_value(args, "--host") == rendered.merged["listenAddress"]
    assert int(flag_value(args, "--port")) == lb_values["port"] == resolve_port(lb, "http")
    assert float(flag_value(args, "--discover-interval")) == lb_values["discoverInterval"]
    assert float(flag_value(args, "--control-timeout")) == lb_values["controlTimeout"]
    assert float(flag_value(args, "--max-control-timeout")) == lb_values["maxControlTimeout"]
    assert float(flag_value(args, "--weight-sync-timeout")) >= lb_values["weightSyncTimeout"] + 90
    assert flag_value(args, "--policy") == lb_values["policy"]
    assert flag_values(args, "--log-format") == (["json"] if rendered.merged["logFormat"] == "json" else [])
    assert _lb(rendered).obj["spec"]["replicas"] == lb_values["replicas"]
    assert all(re.fullmatch(r"[0-9.]+", flag_value(args, f)) for f in ("--control-timeout", "--max-control-timeout"))


def test_one_client_reaches_one_lb_replica(rendered: Rendered) -> None:
    """Each LB replica keeps the weight groups formed through it: a trainer's update or destroy reaching another
    replica goes to that replica's members, not to the group's nodes."""
    def lb_service(r: Rendered) -> dict[str, Any]:
        (service,) = [s for s in r.of_kind("Service") if s.obj["spec"].get("clusterIP") != "None"]
        return service.obj["spec"]

    assert lb_service(rendered)["sessionAffinity"] == rendered.merged["lb"]["service"]["sessionAffinity"] == "ClientIP"
    spread = render(deep_merge(TOKENS, {"lb": {"service": {"sessionAffinity": "None"}}}))
    assert lb_service(spread)["sessionAffinity"] == "None"


def test_lb_replicas_prefer_different_kubernetes_nodes(rendered: Rendered) -> None:
    """Two LB pods on one Kubernetes node: that node's failure takes the cluster's one URL down. The scheduler is
    asked to spread them, softly (a one-node cluster still runs both), and only them: not the node pods."""
    lb = _lb(rendered)
    (term,) = pod_spec(lb)["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    selector = term["podAffinityTerm"]["labelSelector"]["matchLabels"]
    assert selects(selector, pod_labels(lb))
    assert all(not selects(selector, pod_labels(w)) for w in _workloads(rendered) if w is not lb)


def test_the_users_lb_affinity_replaces_the_spread_rule() -> None:
    """``lb.affinity`` is used as given, without the chart's rule; ``lb.podAntiAffinity: none`` drops the rule."""
    theirs = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["cpu"]}]}]}}}
    assert pod_spec(_lb(render(deep_merge(TOKENS, {"lb": {"affinity": theirs}}))))["affinity"] == theirs
    assert "affinity" not in pod_spec(_lb(render(deep_merge(TOKENS, {"lb": {"podAntiAffinity": "none"}}))))
    with pytest.raises(helm.HelmValuesError, match="/lb/podAntiAffinity"):
        render({"lb": {"podAntiAffinity": "hard"}})


def test_a_stopping_lb_lets_its_calls_finish(rendered: Rendered) -> None:
    """uvicorn's default cuts the calls in flight 5 s after SIGTERM: an LB rollout or a drain would cut a
    release fan-out, a weight call (lb.weightSyncTimeout) or a generation stream."""
    lb_values = rendered.merged["lb"]
    lb = container(_lb(rendered), "lb")
    shutdown = float(flag_value(lb["args"], "--shutdown-timeout"))
    assert shutdown == lb_values["shutdownTimeout"] >= float(flag_value(lb["args"], "--weight-sync-timeout"))
    assert pod_spec(_lb(rendered))["terminationGracePeriodSeconds"] > shutdown + 5
    assert lb["lifecycle"]["preStop"]["exec"]["command"][0] == "python", "keep serving while the Service drops it"


def test_weight_timeouts_reach_the_engine_and_the_sidecar(rendered: Rendered) -> None:
    """lb.weightSyncTimeout is the per-node bound of joins, pushes, broadcasts and disk reloads; the engine's
    own bounds (300 s by default) and the sidecar's bound on an engine call (600 s) must not cut them first."""
    weight = rendered.merged["lb"]["weightSyncTimeout"]
    for sts in _node_sets(rendered).values():
        engine, sidecar = container(sts, "engine")["args"], container(sts, "sidecar")["args"]
        assert float(flag_value(engine, "--weight-sync-timeout")) == weight
        assert float(flag_value(engine, "--reload-timeout")) == weight
        assert float(flag_value(sidecar, "--control-timeout")) > weight


@pytest.mark.parametrize("weight", [600, 1800, 30])
def test_the_lb_waits_for_the_engines_own_weight_timeout(weight: int) -> None:
    """Found by review: the LB's per-node deadline on weight calls was lb.weightSyncTimeout, the engine's own
    bound too, so an update the engine ended cleanly at its bound (504 weight_sync_timeout, nothing loaded) raced
    the LB's per-node timeout, and the trainer could not tell whether it landed. The LB now waits past the
    sidecar's bound on its engine call, which waits past the engine's."""
    r = render({"lb": {"weightSyncTimeout": weight, "shutdownTimeout": max(690, weight + 90),
                       "terminationGracePeriodSeconds": max(690, weight + 90) + 30}})
    lb_weight = float(flag_value(container(_lb(r), "lb")["args"], "--weight-sync-timeout"))
    for sts in _node_sets(r).values():
        engine, sidecar = container(sts, "engine")["args"], container(sts, "sidecar")["args"]
        sidecar_bound = float(flag_value(sidecar, "--control-timeout"))
        assert float(flag_value(engine, "--weight-sync-timeout")) == weight
        assert lb_weight >= sidecar_bound + 30 and sidecar_bound >= weight + 60
    with pytest.raises(helm.HelmRenderError, match="must not exceed lb.maxControlTimeout"):
        render({"lb": {"weightSyncTimeout": 3600, "shutdownTimeout": 3690, "terminationGracePeriodSeconds": 3720}})


def test_raised_weight_timeout_reaches_the_engine() -> None:
    r = render({"lb": {"weightSyncTimeout": 1800, "shutdownTimeout": 1890, "terminationGracePeriodSeconds": 1920}})
    for sts in _node_sets(r).values():
        engine, sidecar = container(sts, "engine")["args"], container(sts, "sidecar")["args"]
        assert flag_value(engine, "--weight-sync-timeout") == flag_value(engine, "--reload-timeout") == "1800"
        assert flag_value(sidecar, "--control-timeout") == "1860"


# The longest timeouts the schema takes: every process must still start.
LONGEST_TIMEOUTS: Obj = {"lb": {"weightSyncTimeout": 604800, "maxControlTimeout": 604800, "shutdownTimeout": 604800,
                                "controlTimeout": 604800, "terminationGracePeriodSeconds": 604806,
                                "discoverInterval": 604800},
                         "node": {"sidecar": {"holdRequests": True, "holdTimeout": 604800}}}


def _parse_or_fail(parser: Any, args: list[str], where: str) -> Any:
    try:
        return parser.parse_args(args)
    except SystemExit:
        pytest.fail(f"{where} refuses the args the chart gives it: {args}")


@pytest.mark.parametrize("values", [pytest.param(v, id=k) for k, v in VALUE_SETS.items()]
                         + [pytest.param(LONGEST_TIMEOUTS, id="longest-timeouts")])
def test_every_process_takes_the_args_the_chart_gives_it(values: Obj, tmp_path: Any) -> None:
    """Each container's args, less the process name, go through that process's own argument parser (names, types,
    units, ranges): a flag it does not know or a value it refuses is exit 2 at start, a crash loop. Found by review:
    the sidecar's --control-timeout, lb.weightSyncTimeout + 60, passed the processes' one week (604800 s) for a
    weightSyncTimeout over 604740, which every bound the chart checks allowed."""
    r = render(values)
    lb_args = container(_lb(r), "lb")["args"]
    lb = _parse_or_fail(build_lb_parser(), lb_args[1:], "the LB")
    assert lb.control_timeout == r.merged["lb"]["controlTimeout"] and lb.port == r.merged["lb"]["port"]
    for sts in _node_sets(r).values():
        engine_args, sidecar_args = container(sts, "engine")["args"], container(sts, "sidecar")["args"]
        assert (engine_args[0], sidecar_args[0]) == ("node_engine", "node_sidecar")
        engine = _parse_or_fail(build_engine_parser(), engine_args[1:], "the engine")
        assert engine.port == r.merged["node"]["engine"]["port"] and engine.host == "127.0.0.1"
        assert engine.weight_sync_timeout == engine.reload_timeout == r.merged["lb"]["weightSyncTimeout"]
        # the state file's folder is the pod's emptyDir; here, one that exists (the parser tries to make the file)
        state = flag_value(sidecar_args, "--state-file")
        local = [str(tmp_path / "intent.json") if a == state else a for a in sidecar_args[1:]]
        sidecar = _parse_or_fail(build_sidecar_parser(), local, "the sidecar")
        assert sidecar.engine_url == f"http://127.0.0.1:{engine.port}"
        assert sidecar.port == r.merged["node"]["sidecar"]["port"]
        assert sidecar.drain_timeout == sidecar.shutdown_timeout == engine.shutdown_timeout
        assert sidecar.control_timeout >= engine.weight_sync_timeout


def test_an_auth_change_restarts_the_lb_and_the_nodes_together() -> None:
    """A Secret's new value reaches a container only when it starts: unless the pods roll, a node that restarts
    later gets a token the LB does not send (401 on every control call)."""
    def annotations(values: Obj) -> list[str]:
        r = render(values)
        return [w.obj["spec"]["template"]["metadata"]["annotations"]["checksum/auth"] for w in _workloads(r)]

    first = annotations(TOKENS)
    assert len(set(first)) == 1 and first == annotations(TOKENS), "stable when nothing changes"
    rotated = annotations(deep_merge(TOKENS, {"auth": {"adminToken": "adm-rotated-0123456789"}}))
    assert not set(first) & set(rotated)
    assert not set(annotations({})) & set(annotations({"auth": {"existingSecret": "rl-tokens"}}))
    assert annotations({}) == annotations({}), "generated tokens are kept, so nothing rolls"
    everything = render(TOKENS).all_text
    for token in (ADMIN_TOKEN, API_KEY):
        assert hashlib.sha256(token.encode()).hexdigest() not in everything


# ---- the node pod: engine on localhost, sidecar the only port ----

def test_engine_listens_on_localhost_only_and_sidecar_is_the_only_port(rendered: Rendered) -> None:
    for sts in _node_sets(rendered).values():
        spec = pod_spec(sts)
        assert not spec.get("hostNetwork"), "hostNetwork would put the engine's localhost on the node"
        assert [c["name"] for c in spec["containers"]] == ["engine", "sidecar"]
        engine, sidecar = container(sts, "engine"), container(sts, "sidecar")
        assert engine["args"][0] == "node_engine" and sidecar["args"][0] == "node_sidecar"
        assert flag_value(engine["args"], "--host") == "127.0.0.1"
        assert "ports" not in engine, "the engine must declare no containerPort"
        engine_port = int(flag_value(engine["args"], "--port"))
        assert engine_port == rendered.merged["node"]["engine"]["port"]
        assert flag_value(sidecar["args"], "--engine-url") == f"http://127.0.0.1:{engine_port}"
        assert flag_value(sidecar["args"], "--host") == rendered.merged["listenAddress"]
        (port,) = sidecar["ports"]
        assert port["containerPort"] == int(flag_value(sidecar["args"], "--port")) != engine_port
        assert "--enable-memory-saver" in engine["args"]


def test_lb_and_sidecars_listen_on_ipv6_when_asked() -> None:
    """On an IPv6 cluster a pod has no IPv4 address: bound to 0.0.0.0, the LB and the sidecars were reachable by
    neither the kubelet's probes nor the LB (every node restarted by its liveness probe, forever)."""
    default = render({})
    assert flag_value(container(_lb(default), "lb")["args"], "--host") == "0.0.0.0"
    r = render({"listenAddress": "::"})
    assert flag_value(container(_lb(r), "lb")["args"], "--host") == "::"
    for sts in _node_sets(r).values():
        assert flag_value(container(sts, "sidecar")["args"], "--host") == "::"
        assert flag_value(container(sts, "engine")["args"], "--host") == "127.0.0.1"
    with pytest.raises(helm.HelmValuesError, match="at '/listenAddress'"):
        render({"listenAddress": "10.0.0.1"})


def test_probes_point_at_health_and_ready(rendered: Rendered) -> None:
    lb = container(_lb(rendered), "lb")
    for probe in ("livenessProbe", "readinessProbe"):
        assert lb[probe]["httpGet"]["path"] == "/health"
        assert resolve_port(lb, lb[probe]["httpGet"]["port"]) == int(flag_value(lb["args"], "--port"))
    for sts in _node_sets(rendered).values():
        sidecar, engine = container(sts, "sidecar"), container(sts, "engine")
        sidecar_port = int(flag_value(sidecar["args"], "--port"))
        assert sidecar["livenessProbe"]["httpGet"]["path"] == "/health"
        assert sidecar["readinessProbe"]["httpGet"]["path"] == "/ready"
        for probe in ("livenessProbe", "readinessProbe"):
            assert resolve_port(sidecar, sidecar[probe]["httpGet"]["port"]) == sidecar_port
        # The engine is only reachable from inside its pod: its probes (when on) run there.
        engine_probes = [engine[p] for p in ("startupProbe", "livenessProbe") if p in engine]
        assert "readinessProbe" not in engine
        assert len(engine_probes) == (2 if rendered.merged["node"]["engine"]["livenessProbe"]["enabled"] else 0)
        engine_url = f"http://127.0.0.1:{flag_value(engine['args'], '--port')}/health"
        for probe in engine_probes:
            assert "httpGet" not in probe and "tcpSocket" not in probe
            assert engine_url in " ".join(probe["exec"]["command"])


def test_gpus_are_requested_by_the_engine_only(rendered: Rendered) -> None:
    engine_values = rendered.merged["node"]["engine"]
    gpu = engine_values["gpuResourceName"]
    for sts in _node_sets(rendered).values():
        engine = container(sts, "engine")
        assert flag_value(engine["args"], "--device") == engine_values["device"]
        resources = engine["resources"]
        if engine_values["device"] == "cuda":
            assert resources["limits"][gpu] == resources["requests"][gpu] == engine_values["gpus"] == 1
        else:
            assert gpu not in resources.get("limits", {}) and gpu not in resources.get("requests", {})
        assert gpu not in json.dumps(container(sts, "sidecar").get("resources", {}))
    assert gpu not in json.dumps(container(_lb(rendered), "lb").get("resources", {}))


def test_containers_given_no_gpu_get_none_from_the_nvidia_runtime(rendered: Rendered) -> None:
    """The CUDA image sets NVIDIA_VISIBLE_DEVICES=all: where the NVIDIA runtime is the node's default, a container
    that requests no GPU got every GPU of the host (other pods' GPUs) unless the variable says otherwise."""
    void = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}
    engine_values = rendered.merged["node"]["engine"]
    assert env_entries(container(_lb(rendered), "lb"))["NVIDIA_VISIBLE_DEVICES"] == void
    for sts in _node_sets(rendered).values():
        assert env_entries(container(sts, "sidecar"))["NVIDIA_VISIBLE_DEVICES"] == void
        engine_env = env_entries(container(sts, "engine"))
        if engine_values["device"] == "cuda" and engine_values["gpus"]:
            assert "NVIDIA_VISIBLE_DEVICES" not in engine_env, "the device plugin names the engine's GPU"
        else:
            assert engine_env["NVIDIA_VISIBLE_DEVICES"] == void


def test_an_engine_given_no_gpu_gets_none() -> None:
    r = render({"node": {"engine": {"device": "cpu", "gpus": 0}}})
    for sts in _node_sets(r).values():
        engine = container(sts, "engine")
        assert "nvidia.com/gpu" not in json.dumps(engine["resources"])
        assert env_entries(engine)["NVIDIA_VISIBLE_DEVICES"]["value"] == "void"


def test_a_cuda_engine_given_its_gpus_by_its_own_variable_gets_that_one_only() -> None:
    """Before: the chart's "void" came first and the user's second, two definitions of one variable in the spec."""
    own = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "0"}
    r = render({"node": {"engine": {"gpus": 0, "extraEnv": [own]}}})
    for sts in _node_sets(r).values():
        engine = container(sts, "engine")
        assert [e for e in engine["env"] if e["name"] == own["name"]] == [own]
        assert "nvidia.com/gpu" not in json.dumps(engine["resources"])


def test_engine_and_sidecar_flags_follow_the_values(rendered: Rendered) -> None:
    engine_values, sidecar_values = rendered.merged["node"]["engine"], rendered.merged["node"]["sidecar"]
    for role, sts in _node_sets(rendered).items():
        engine, sidecar = container(sts, "engine")["args"], container(sts, "sidecar")["args"]
        assert flag_value(engine, "--model-path") == rendered.merged["model"]["path"]
        assert flag_value(engine, "--weights-backup") == engine_values["weightsBackup"]
        for flag, key in (("--max-total-tokens", "maxTotalTokens"), ("--max-batch-tokens", "maxBatchTokens")):
            expected = [str(engine_values[key])] if engine_values[key] else []
            assert flag_values(engine, flag) == expected, "integers must render without exponent or decimals"
        assert flag_values(engine, "--dtype") == ([engine_values["dtype"]] if engine_values["dtype"] else [])
        assert flag_values(engine, "--role") == ([] if role == "mixed" else [role])
        for args in (engine, sidecar):
            assert flag_values(args, "--log-format") == (["json"] if rendered.merged["logFormat"] == "json" else [])
        assert float(flag_value(sidecar, "--drain-timeout")) == sidecar_values["drainTimeout"]
        for args in (engine, sidecar):  # a stopping pod's requests get the drain timeout, not uvicorn's 5 s
            assert float(flag_value(args, "--shutdown-timeout")) == sidecar_values["drainTimeout"]
        if sidecar_values["holdRequests"]:
            assert "--hold-requests" in sidecar
            assert int(flag_value(sidecar, "--hold-max")) == sidecar_values["holdMax"]
            assert float(flag_value(sidecar, "--hold-timeout")) == sidecar_values["holdTimeout"]
        else:
            assert not {"--hold-requests", "--hold-max", "--hold-timeout"} & set(sidecar)
        for extra in rendered.merged["roles"][role]["engineExtraArgs"]:
            assert extra in engine
        grace = pod_spec(sts)["terminationGracePeriodSeconds"]
        assert grace > sidecar_values["drainTimeout"], "a stopping node must get time to drain"


@pytest.mark.parametrize("limit", ["1Gi", "3G", "1536Mi", 2147483648, "128Mi"])
def test_the_sidecar_holds_bodies_within_its_memory_limit(limit: str | int) -> None:
    """Before: the chart left --hold-max-bytes at the process's 1 GiB, the sidecar's whole default memory limit: the
    requests a paused node holds (a weight update) got the sidecar OOM-killed, with every held and running request,
    before it answered one 503. The held bodies now take at most a quarter of the limit, and the bodies and answers
    of the requests it runs (--max-inflight-bytes) another quarter. Found by review: --max-buffered-body-bytes (the
    bodies of all its requests, arriving, held or running) stayed at 1 GiB too; it now gets those two quarters."""
    default = build_sidecar_parser().get_default("hold_max_bytes")
    for values in ({}, {"node": {"sidecar": {"resources": {"limits": {"memory": limit}}}}}):
        r = render(values)
        limit_bytes = quantity_bytes(r.merged["node"]["sidecar"]["resources"]["limits"]["memory"])
        for sts in _node_sets(r).values():
            args = container(sts, "sidecar")["args"]
            held = [int(v) for v in flag_values(args, "--hold-max-bytes")] or [default]
            assert held[-1] == limit_bytes // 4
            in_flight = [int(v) for v in flag_values(args, "--max-inflight-bytes")]
            assert in_flight == [max(limit_bytes // 4, 64 << 20)]  # at least the sidecar's --max-body-bytes
            buffered = [int(v) for v in flag_values(args, "--max-buffered-body-bytes")]
            assert buffered == [max(limit_bytes // 2, 64 << 20)]


def test_a_sidecar_without_memory_limit_or_with_its_own_hold_bound_keeps_it() -> None:
    r = render({"node": {"sidecar": {"resources": {"limits": None}}}})
    for sts in _node_sets(r).values():
        assert flag_values(container(sts, "sidecar")["args"], "--hold-max-bytes") == []
        assert flag_values(container(sts, "sidecar")["args"], "--max-inflight-bytes") == []
        assert flag_values(container(sts, "sidecar")["args"], "--max-buffered-body-bytes") == []
    r = render({"node": {"sidecar": {"extraArgs": ["--hold-max-bytes", "1000"]}}})
    for sts in _node_sets(r).values():  # the last value is argparse's
        assert flag_values(container(sts, "sidecar")["args"], "--hold-max-bytes")[-1] == "1000"


@pytest.mark.parametrize("limit", ["1Gi", "3G", "1536Mi", 2147483648, "96Mi"])
def test_the_lb_holds_bodies_within_its_memory_limit(limit: str | int) -> None:
    """Found by review: the chart left the LB's --max-buffered-body-bytes at the process's 1 GiB, the LB's whole
    default memory limit. A real LB holding 17 bodies of 60 MiB (RL batches of prompts, images) reached 1073 MiB
    RSS before its first 503 `overloaded`: under the 1Gi limit the cgroup's OOM killer ends the cluster's one URL,
    every stream through it included, instead. The bodies now take at most half the limit, at least 64 MiB (the
    LB's --max-body-bytes, below which it refuses to start); with no limit the process's default stays."""
    for values in ({}, {"lb": {"resources": {"limits": {"memory": limit}}}}):
        r = render(values)
        limit_bytes = quantity_bytes(r.merged["lb"]["resources"]["limits"]["memory"])
        buffered = [int(v) for v in flag_values(container(_lb(r), "lb")["args"], "--max-buffered-body-bytes")]
        assert buffered == [max(limit_bytes // 2, 64 << 20)]
    unlimited = container(_lb(render({"lb": {"resources": {"limits": None}}})), "lb")["args"]
    assert flag_values(unlimited, "--max-buffered-body-bytes") == []
    own = container(_lb(render({"lb": {"extraArgs": ["--max-buffered-body-bytes", "1000000000"]}})), "lb")["args"]
    assert flag_values(own, "--max-buffered-body-bytes")[-1] == "1000000000"  # the last value is argparse's


@pytest.mark.parametrize("limit", ["1Gi", "3G", "96Mi"])
def test_the_lb_holds_answers_within_its_memory_limit(limit: str) -> None:
    """Found by review: the LB's buffered non-stream answers had no bound in all (each up to 256 MiB): a few at
    once passed the 1Gi limit. They now take a quarter of it, at least one answer of the largest size."""
    r = render({"lb": {"resources": {"limits": {"memory": limit}}}})
    answers = [int(v) for v in flag_values(container(_lb(r), "lb")["args"], "--max-buffered-answer-bytes")]
    assert answers == [max(quantity_bytes(limit) // 4, 256 << 20)]
    unlimited = container(_lb(render({"lb": {"resources": {"limits": None}}})), "lb")["args"]
    assert flag_values(unlimited, "--max-buffered-answer-bytes") == []


def test_weights_backup_dir_is_a_mounted_volume(rendered: Rendered) -> None:
    engine_values = rendered.merged["node"]["engine"]
    for sts in _node_sets(rendered).values():
        engine = container(sts, "engine")
        volumes = {v["name"]: v for v in pod_spec(sts)["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in engine["volumeMounts"]}
        on_disk = engine_values["weightsBackup"] == "disk" or (
            engine_values["weightsBackup"] == "cpu" and engine_values["device"] == "cpu")
        if not on_disk:  # none, or a CUDA engine's cpu backup: pinned host memory, no folder
            assert not flag_values(engine["args"], "--backup-dir") and "backup" not in volumes
        else:
            backup_dir = flag_value(engine["args"], "--backup-dir")
            assert "emptyDir" in volumes[mounts[backup_dir]]
            if engine_values["backupSizeLimit"]:
                assert volumes[mounts[backup_dir]]["emptyDir"]["sizeLimit"] == engine_values["backupSizeLimit"]


@pytest.mark.parametrize(("engine", "reserved"), [
    pytest.param({"weightsBackup": "disk", "backupSizeLimit": "150Gi"}, "150Gi", id="disk"),
    pytest.param({"device": "cpu", "gpus": 0, "weightsBackup": "cpu", "backupSizeLimit": "8Gi"}, "8Gi",
                 id="cpu-engine-spills-to-files"),
    pytest.param({"weightsBackup": "cpu", "backupSizeLimit": "150Gi"}, None, id="cuda-cpu-backup-is-host-memory"),
    pytest.param({"weightsBackup": "none"}, None, id="none"),
    pytest.param({"weightsBackup": "disk", "backupSizeLimit": "150Gi",
                  "resources": {"requests": {"ephemeral-storage": "200Gi"}}}, "200Gi", id="request-given"),
])
def test_a_backup_on_the_nodes_disk_is_reserved_there(engine: Obj, reserved: str | None) -> None:
    """A disk backup (a model's size) went to an emptyDir with no ephemeral-storage request: the scheduler placed the
    pod on a node without room, and a kubelet short of disk evicts first the pods most over their requests (0): the
    GPU node, its backup with it, during training."""
    r = render({"node": {"engine": engine}})
    _assert_valid_for_kubernetes(r)
    for sts in _node_sets(r).values():
        requests = container(sts, "engine")["resources"].get("requests", {})
        assert requests.get("ephemeral-storage") == reserved
        assert "ephemeral-storage" not in (container(sts, "sidecar")["resources"].get("requests") or {})


def test_a_cuda_engines_cpu_backup_gets_no_backup_folder() -> None:
    """A CUDA engine keeps a cpu backup in pinned host memory: the chart passed --backup-dir all the same, on an
    emptyDir never written, and the engine logged a WARNING that the flag is not used at every start."""
    r = render({"node": {"engine": {"weightsBackup": "cpu"}}})
    for sts in _node_sets(r).values():
        engine = container(sts, "engine")
        assert flag_value(engine["args"], "--weights-backup") == "cpu"
        assert not flag_values(engine["args"], "--backup-dir")
        assert "backup" not in {v["name"] for v in pod_spec(sts)["volumes"]}


def test_the_weight_sync_ports_are_the_node_pods_ephemeral_ports() -> None:
    """The policy opens weightSyncPorts for the torch process group's members, which listen on ports from their
    pod's ephemeral range: the chart assumed the kernel's default range, and a pod with another one (a kernel or a
    runtime that sets it) refused the trainer's connections and every broadcast join timed out."""
    trainer = [{"podSelector": {"matchLabels": {"job-role": "trainer"}}}]
    kept = {"name": "net.ipv4.tcp_keepalive_time", "value": "60"}
    for ports in ({"start": 32768, "end": 60999}, {"start": 40000, "end": 44095}):
        r = render({"networkPolicy": {"enabled": True, "trainerFrom": trainer, "weightSyncPorts": ports},
                    "podSecurityContext": {"sysctls": [kept]}})
        _assert_valid_for_kubernetes(r)
        (_, sync_rule) = _policies(r)["node"]["ingress"]
        ((first, last),) = _ports(sync_rule)
        for sts in _node_sets(r).values():
            sysctls = pod_spec(sts)["securityContext"]["sysctls"]
            assert sysctls == [kept, {"name": "net.ipv4.ip_local_port_range", "value": f"{first} {last}"}]
            assert pod_spec(sts)["securityContext"]["runAsNonRoot"] is True
        assert pod_spec(_lb(r))["securityContext"]["sysctls"] == [kept], "the LB takes no weight-sync connection"
    for values in ({}, {"networkPolicy": {"enabled": True}}):  # no weight-sync rule: the pods' range is theirs
        r = render(values)
        for sts in _node_sets(r).values():
            assert "sysctls" not in pod_spec(sts)["securityContext"]


def test_the_sidecar_keeps_its_state_in_an_emptydir_of_its_own(rendered: Rendered) -> None:
    """It outlives a restart of either container (an OOM, a rollout restart of one): a sidecar restarted with its
    engine releases the fresh engine again and holds out its start weights."""
    for sts in _node_sets(rendered).values():
        state_file = flag_value(container(sts, "sidecar")["args"], "--state-file")
        folder = state_file.rsplit("/", 1)[0]
        mounts = {m["mountPath"]: m["name"] for m in container(sts, "sidecar")["volumeMounts"]}
        volume = {v["name"]: v for v in pod_spec(sts)["volumes"]}[mounts[folder]]
        assert "emptyDir" in volume and "medium" not in volume["emptyDir"]  # on the node's disk, not its memory
        assert mounts[folder] not in {m["name"] for m in container(sts, "engine")["volumeMounts"]}


def test_model_volume_follows_the_values(rendered: Rendered) -> None:
    model = rendered.merged["model"]
    kind = model["volume"]["type"]
    pvcs = rendered.of_kind("PersistentVolumeClaim")
    for sts in _node_sets(rendered).values():
        volumes = {v["name"]: v for v in pod_spec(sts)["volumes"]}
        engine = container(sts, "engine")
        mounts = {m["name"]: m for m in engine["volumeMounts"]}
        assert "model" not in {m["name"] for m in container(sts, "sidecar").get("volumeMounts", [])}
        if kind == "none":
            assert "model" not in volumes and "model" not in mounts and not pvcs
            continue
        assert mounts["model"]["mountPath"] == model["mountPath"]
        assert mounts["model"]["readOnly"] is model["readOnly"]
        assert flag_value(engine["args"], "--model-path").startswith(model["mountPath"] + "/")
        if kind == "hostPath":
            assert volumes["model"]["hostPath"] == model["volume"]["hostPath"] and not pvcs
        elif kind == "existingClaim":
            claim = model["volume"]["existingClaim"]["claimName"]
            assert volumes["model"]["persistentVolumeClaim"]["claimName"] == claim
            assert not pvcs
        else:
            (pvc,) = pvcs
            assert volumes["model"]["persistentVolumeClaim"]["claimName"] == pvc.name
            assert pvc.obj["spec"]["resources"]["requests"]["storage"] == model["volume"]["pvc"]["size"]
            assert pvc.obj["spec"]["accessModes"] == model["volume"]["pvc"]["accessModes"]
            assert pvc.obj["spec"].get("storageClassName") == (model["volume"]["pvc"]["storageClassName"] or None)
            assert pvc.obj["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_pods_run_as_non_root_without_api_credentials(rendered: Rendered) -> None:
    for w in _workloads(rendered):
        spec = pod_spec(w)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["image"].endswith(":0.1.0")
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert "/tmp" in mounts and env_entries(c)["HOME"]["value"] == "/tmp", "a writable HOME and caches"


def test_volume_ownership_is_changed_only_when_its_root_differs(rendered: Rendered) -> None:
    """With fsGroup and the default policy (Always) the kubelet walks every file of a model or checkpoint claim
    at each node pod's start (minutes on a large claim) and rewrites the group and mode of the trainer's files."""
    for w in _workloads(rendered):
        context = pod_spec(w)["securityContext"]
        assert context["fsGroup"] == 10001 and context["fsGroupChangePolicy"] == "OnRootMismatch"


# ---- tokens ----

def test_no_token_appears_in_plain_text(rendered: Rendered) -> None:
    given = rendered.merged["auth"]
    tokens = [t for t in (given["adminToken"], given["apiKey"]) if t]
    everything = rendered.all_text
    for token in tokens:
        assert token not in everything
        holders = [m for m in rendered.manifests if b64(token) in json.dumps(m.obj)]
        assert [m.kind for m in holders] == ["Secret"], "the token may only be in the Secret's data"
    for w in _workloads(rendered):
        for c in pod_spec(w)["containers"]:
            assert not {"--admin-token", "--api-key"} & {a.split("=")[0] for a in c["args"]}
            for e in c.get("env") or []:
                if e["name"].startswith("HANDOFF_"):
                    assert "value" not in e and "secretKeyRef" in e["valueFrom"], f"{w.name}/{c['name']}: {e}"


def test_names_and_paths_yaml_reads_as_other_types_reach_kubernetes_as_written() -> None:
    """Secret keys, a claim's name and paths went into the YAML unquoted: a key "on" or "null" became the boolean
    true or null (the API server refuses a secretKeyRef key that is not a string; the chart's Secret got the key
    "true"), a claim named "2024" a number, and a path with " #" lost its end to a comment (the engine's
    --backup-dir, quoted, and its mount then differed)."""
    values = {
        "auth": {"adminTokenKey": "on", "apiKeyKey": "null"},
        "model": {"path": "/models/x", "volume": {"type": "existingClaim", "existingClaim": {"claimName": "2024"}}},
        "node": {"engine": {"weightsBackup": "disk", "backupSizeLimit": "20Gi", "backupDir": "/var/backup #1"},
                 "priorityClassName": "true"},
    }
    for extra in ({}, {"auth": {"existingSecret": "1234"}}):
        r = render(deep_merge(values, extra))
        _assert_valid_for_kubernetes(r)
        secret_name = extra.get("auth", {}).get("existingSecret", f"{RELEASE}-handoff-auth")
        for w in _workloads(r):
            for c in pod_spec(w)["containers"]:
                refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c.get("env") or [] if "valueFrom" in e}
                if refs:
                    assert refs["HANDOFF_ADMIN_TOKEN"] == {"name": secret_name, "key": "on"}
                    assert refs["HANDOFF_API_KEY"] == {"name": secret_name, "key": "null"}
        for secret in r.of_kind("Secret"):
            assert sorted(secret.obj["data"]) == ["null", "on"]
        assert r.notes.count("jsonpath='{.data.on}'") == 1 and r.notes.count("jsonpath='{.data.null}'") == 1
        for sts in _node_sets(r).values():
            spec = pod_spec(sts)
            assert spec["priorityClassName"] == "true"
            volumes = {v["name"]: v for v in spec["volumes"]}
            assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "2024"
            engine = container(sts, "engine")
            mounts = {m["name"]: m["mountPath"] for m in engine["volumeMounts"]}
            assert mounts["backup"] == flag_value(engine["args"], "--backup-dir") == "/var/backup #1"


def test_a_dotted_secret_key_is_escaped_in_the_notes_jsonpath() -> None:
    r = render({"auth": {"adminTokenKey": "admin.token", "apiKeyKey": "api.key"}})
    assert "jsonpath='{.data.admin\\.token}'" in r.notes and "jsonpath='{.data.api\\.key}'" in r.notes


def test_tokens_reach_the_lb_and_sidecars_from_the_secret(rendered: Rendered) -> None:
    auth = rendered.merged["auth"]
    secret_name = auth["existingSecret"] or f"{rendered.release}-handoff-auth"
    secrets = rendered.of_kind("Secret")
    if auth["existingSecret"]:
        assert not secrets, "with auth.existingSecret the chart creates no Secret"
    else:
        (secret,) = secrets
        assert secret.name == secret_name
        assert set(secret.obj["data"]) == {auth["adminTokenKey"], auth["apiKeyKey"]}
        for key, given in ((auth["adminTokenKey"], auth["adminToken"]), (auth["apiKeyKey"], auth["apiKey"])):
            decoded = base64.b64decode(secret.obj["data"][key]).decode()
            assert decoded == given if given else re.fullmatch(r"[A-Za-z0-9]{32}", decoded)
    holders = [container(_lb(rendered), "lb")] + [container(s, "sidecar") for s in _node_sets(rendered).values()]
    for c in holders:
        env = env_entries(c)
        for var, key in (("HANDOFF_ADMIN_TOKEN", auth["adminTokenKey"]), ("HANDOFF_API_KEY", auth["apiKeyKey"])):
            assert env[var]["valueFrom"]["secretKeyRef"] == {"name": secret_name, "key": key}
    for sts in _node_sets(rendered).values():
        assert not [n for n in env_entries(container(sts, "engine")) if n.startswith("HANDOFF_")], \
            "the engine is on localhost behind the sidecar and gets no token"


# ---- network policies ----

def _policies(r: Rendered) -> dict[str, Obj]:
    """The NetworkPolicies' specs by the component they guard (node, lb)."""
    return {p.labels["app.kubernetes.io/component"]: p.obj["spec"] for p in r.of_kind("NetworkPolicy")}


def _guarded(r: Rendered, spec: Obj) -> list[str]:
    return [w.name for w in _workloads(r) if selects(spec["podSelector"]["matchLabels"], pod_labels(w))]


def _ports(rule: Obj) -> list[tuple[int, int]]:
    """A rule's TCP ports as (first, last)."""
    assert all(p["protocol"] == "TCP" for p in rule["ports"])
    return [(p["port"], p.get("endPort", p["port"])) for p in rule["ports"]]


def test_network_policies_are_off_by_default(rendered: Rendered) -> None:
    asked = rendered.values.get("networkPolicy", {}).get("enabled", False)
    assert rendered.merged["networkPolicy"]["enabled"] is asked  # existing installs must not change
    assert bool(rendered.of_kind("NetworkPolicy")) is asked


def test_network_policies_with_defaults_admit_the_lb_to_the_sidecars_only() -> None:
    r = render({"networkPolicy": {"enabled": True}})
    _assert_valid_for_kubernetes(r)
    policies = _policies(r)
    assert sorted(policies) == ["lb", "node"]
    node, lb = policies["node"], policies["lb"]
    assert _guarded(r, node) == [s.name for s in r.of_kind("StatefulSet")]
    assert _guarded(r, lb) == [_lb(r).name]
    for spec in (node, lb):
        assert spec["policyTypes"] == ["Ingress"], "egress stays open (the engines connect out to the trainer)"
    # The sidecar's port, from the LB pods only; no rule names the engine's port or the weight-sync range.
    (rule,) = node["ingress"]
    assert _ports(rule) == [(8080, 8080)]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"} and selects(peer["podSelector"]["matchLabels"], pod_labels(_lb(r)))
    assert not any(selects(peer["podSelector"]["matchLabels"], pod_labels(s)) for s in r.of_kind("StatefulSet"))
    # The LB's port, from anywhere.
    (rule,) = lb["ingress"]
    assert _ports(rule) == [(8000, 8000)] and "from" not in rule


def test_network_policies_follow_each_peer_list() -> None:
    clients = {"namespaceSelector": {"matchLabels": {"team": "rl"}}}
    scraper = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
               "podSelector": {}}
    trainer = {"podSelector": {"matchLabels": {"app": "trainer"}}}

    def policies(**lists: list[Obj]) -> dict[str, Obj]:
        r = render({"networkPolicy": {"enabled": True, **lists}})
        _assert_valid_for_kubernetes(r)
        return _policies(r)

    lb_only = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "handoff",
                                               "app.kubernetes.io/instance": RELEASE,
                                               "app.kubernetes.io/component": "lb"}}}
    p = policies(clientsFrom=[clients])
    assert p["lb"]["ingress"][0]["from"] == [clients]
    assert p["node"]["ingress"] == [{"from": [lb_only], "ports": [{"protocol": "TCP", "port": 8080}]}]
    p = policies(metricsFrom=[scraper])
    assert "from" not in p["lb"]["ingress"][0], "with no clientsFrom the LB stays open to all, scrapers included"
    assert p["node"]["ingress"] == [{"from": [lb_only, scraper], "ports": [{"protocol": "TCP", "port": 8080}]}]
    p = policies(clientsFrom=[clients], metricsFrom=[scraper])
    assert p["lb"]["ingress"][0]["from"] == [clients, scraper]
    p = policies(trainerFrom=[trainer])
    sidecar_rule, sync_rule = p["node"]["ingress"]
    assert sidecar_rule["from"] == [lb_only]
    release_nodes = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "handoff",
                                                     "app.kubernetes.io/instance": RELEASE,
                                                     "app.kubernetes.io/component": "node"}}}
    assert sync_rule["from"] == [trainer, release_nodes], "the group's engines connect to each other too"
    assert _ports(sync_rule) == [(32768, 60999)]
    assert "from" not in p["lb"]["ingress"][0]


def test_network_policy_ports_follow_the_containers() -> None:
    r = render(VALUE_SETS["network-policy"])
    policies = _policies(r)
    lb_port = resolve_port(container(_lb(r), "lb"), "http")
    assert _ports(policies["lb"]["ingress"][0]) == [(lb_port, lb_port)] == [(9000, 9000)]
    sidecar_rule, sync_rule = policies["node"]["ingress"]
    for sts in r.of_kind("StatefulSet"):
        sidecar_port = resolve_port(container(sts, "sidecar"), "http")
        engine_port = int(flag_value(container(sts, "engine")["args"], "--port"))
        assert _ports(sidecar_rule) == [(sidecar_port, sidecar_port)]
        assert _ports(sync_rule) == [(40000, 40999)]
        for first, last in _ports(sidecar_rule) + _ports(sync_rule):
            assert not first <= engine_port <= last, "the engine's port admits no other pod"
    assert len(_guarded(r, policies["node"])) == 3


# ---- monitoring ----

SERVICE_MONITOR_SCHEMA: Obj = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {"type": "object", "required": ["matchLabels"], "additionalProperties": False,
                             "properties": {"matchLabels": {"type": "object",
                                                            "additionalProperties": {"type": "string"}}}},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["port"], "additionalProperties": False,
                    "properties": {"port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                                   "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                                   "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}}}},
            },
        },
    },
}


def test_monitoring_is_off_by_default() -> None:
    r = render({})
    assert not r.of_kind("ServiceMonitor") and not r.of_kind("ConfigMap")


def test_service_monitor_scrapes_the_lb_and_every_node(monitoring: Rendered) -> None:
    (sm,) = monitoring.of_kind("ServiceMonitor")
    Draft202012Validator(SERVICE_MONITOR_SCHEMA).validate(sm.obj)
    assert sm.labels["release"] == "kube-prometheus-stack"
    selector = sm.obj["spec"]["selector"]["matchLabels"]
    scraped = {s.name for s in monitoring.of_kind("Service") if selects(selector, s.labels)}
    assert scraped == {s.name for s in monitoring.of_kind("Service")}
    assert len(scraped) == 1 + len(ROLES)
    (endpoint,) = sm.obj["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    for svc in monitoring.of_kind("Service"):
        assert endpoint["port"] in {p["name"] for p in svc.obj["spec"]["ports"]}


def test_dashboard_queries_only_metrics_the_processes_export(monitoring: Rendered) -> None:
    declared = declared_metrics()
    assert len(declared) >= 30, f"parsed too few metrics from {METRICS_MODULES}: {sorted(declared)}"
    exported = exported_series(declared)
    dashboard = dashboard_from(monitoring)
    queried = queried_metrics(dashboard)
    assert queried, "the dashboard queries nothing"
    assert not queried - exported, f"queried but never exported: {sorted(queried - exported)}"
    # The panels issue 7 asks for.
    for needed in ("handoff_node_memory_bytes", "handoff_node_release_seconds_bucket",
                   "handoff_node_resume_seconds_bucket", "handoff_lb_fanout_node_failures_total",
                   "handoff_node_inflight_requests", "handoff_node_held_requests",
                   "handoff_engine_generated_tokens_total"):
        assert needed in queried, needed


def test_dashboard_is_well_formed(monitoring: Rendered) -> None:
    dashboard = dashboard_from(monitoring)
    on_disk = json.loads((CHART_DIR / "files" / "dashboards" / "handoff.json").read_text())
    assert dashboard == on_disk
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    ids = []
    for panel in panels(dashboard):
        ids.append(panel["id"])
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        for target in panel["targets"]:
            expr = target["expr"]
            for open_, close in ("()", "{}", "[]"):
                assert expr.count(open_) == expr.count(close), f"{panel['title']}: unbalanced {open_}{close}"
            for var in re.findall(r"\$(\w+)", expr):
                assert var in variables or var.startswith("__"), f"{panel['title']}: unknown variable ${var}"
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    titles = " ".join(p["title"].lower() for p in panels(dashboard))
    for topic in ("memory by tag and state", "release latency", "resume latency", "fan-out failures",
                  "in-flight", "held", "tokens per second"):
        assert topic in titles, topic


# ---- NOTES.txt ----

def test_notes_show_generate_release_and_resume_through_the_lb(rendered: Rendered) -> None:
    notes = rendered.notes
    lb_service = next(s for s in rendered.of_kind("Service") if s.labels["app.kubernetes.io/component"] == "lb")
    port = lb_service.obj["spec"]["ports"][0]["port"]
    assert f"http://{lb_service.name}.{rendered.namespace}.svc.{rendered.merged['clusterDomain']}:{port}" in notes
    for path in ("/generate", "/release_memory_occupation", "/resume_memory_occupation"):
        assert re.search(rf'curl [^\n]*"\$HANDOFF_URL{path}"', notes), path
    secret = rendered.merged["auth"]["existingSecret"] or f"{rendered.release}-handoff-auth"
    assert f"get secret {secret}" in notes
