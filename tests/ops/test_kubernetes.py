"""The Kubernetes deployment (ops/deploy/kubernetes): every overlay renders with `kubectl kustomize` after
the documented secrets step, validates offline against the Kubernetes schemas, and agrees with what the
gateway and the remote engine need (its config loads for a fleet, the engines run the flags the remote
engine's contract names, the probes and the grace period fit the drain)."""

from __future__ import annotations

import base64
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from gateway.config import Config, load_config, with_workers
from gateway.observe.metrics import PREFIX
from gateway.observe.multiproc import GAUGE_MODES
from ops.deploy import secrets
from ops.deploy.vllm_server import server_flags

KUBERNETES = Path(__file__).resolve().parents[2] / "ops" / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUBERNETES / "overlays").iterdir() if p.is_dir())
# Kinds of custom resources, whose schemas come with their operators (not with Kubernetes): checked below.
CUSTOM_KINDS = {"ServiceMonitor"}

Doc = dict[str, Any]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[Doc]:
    """The overlay rendered as README "Deploying" says: fresh secrets written into it, then kustomize."""
    kubectl = shutil.which("kubectl")
    assert kubectl is not None, "kubectl is needed to render the manifests (Debian package kubectl)"
    tree = tmp_path_factory.mktemp("kubernetes") / "kubernetes"
    shutil.copytree(KUBERNETES, tree)
    overlay = tree / "overlays" / request.param
    assert secrets.main([str(overlay)]) == 0
    out = subprocess.run(
        [kubectl, "kustomize", str(overlay)], capture_output=True, text=True, check=False, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def one(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name)]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def container(doc: Doc, name: str) -> Doc:
    (found,) = [c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return dict(found)


def secret_data(docs: list[Doc], name: str) -> dict[str, str]:
    data = one(docs, "Secret", name)["data"]
    return {key: base64.b64decode(value).decode() for key, value in data.items()}


@pytest.fixture(scope="module")
def config(rendered: list[Doc], tmp_path_factory: pytest.TempPathFactory) -> Config:
    """The config a gateway pod loads: the ConfigMap's TOML and its environment, secrets resolved."""
    toml = one(rendered, "ConfigMap", "lockgate-config")["data"]["lockgate.toml"]
    gateway = container(one(rendered, "Deployment", "lockgate-gateway"), "gateway")
    env: dict[str, str] = {}
    for var in gateway["env"]:
        ref = var["valueFrom"]["secretKeyRef"]
        env[var["name"]] = secret_data(rendered, ref["name"])[ref["key"]]
    path = tmp_path_factory.mktemp("config") / "lockgate.toml"
    path.write_text(toml, encoding="utf-8")
    return load_config(path, env=env)


def test_every_object_is_valid_against_the_kubernetes_schemas(rendered: list[Doc]) -> None:
    version = kubernetes_validate.latest_version()
    kinds = set()
    for doc in rendered:
        kinds.add(doc["kind"])
        if doc["kind"] in CUSTOM_KINDS:
            continue
        # strict: a field the schema does not know (a typo, a wrong level) is an error.
        kubernetes_validate.validate(doc, version, strict=True)
    assert kinds >= {
        "ConfigMap",
        "Secret",
        "Deployment",
        "StatefulSet",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ServiceMonitor",
        "NetworkPolicy",
    }


def test_a_typo_fails_the_validation(rendered: list[Doc]) -> None:
    """The check can fail: a misspelt probe field is refused."""
    gateway = yaml.safe_load(yaml.safe_dump(one(rendered, "Deployment", "lockgate-gateway")))
    probe = gateway["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    probe["periodSecond"] = probe.pop("periodSeconds")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(gateway, kubernetes_validate.latest_version(), strict=True)


def test_the_gateway_config_is_fit_for_a_fleet(rendered: list[Doc], config: Config) -> None:
    # Every piece of state that replicas share is outside them (the check `--workers N` makes).
    with_workers(config, 2)
    assert config.storage.backend == "postgres"
    assert config.quota.backend == "redis"
    assert len(config.audit.mac_key) >= 32
    assert config.storage.postgres_dsn.startswith("postgresql://lockgate:")
    postgres = container(one(rendered, "StatefulSet", "postgres"), "postgres")
    password = {v["name"]: v for v in postgres["env"]}["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert f":{secret_data(rendered, password['name'])[password['key']]}@" in config.storage.postgres_dsn
    # The store hosts are the Services of the manifests.
    services = {d["metadata"]["name"]: d for d in rendered if d["kind"] == "Service"}
    assert urlsplit(config.quota.redis_url).hostname in services
    assert urlsplit(config.storage.postgres_dsn).hostname in services


def test_the_signing_key_is_mounted_with_its_public_key(rendered: list[Doc], config: Config) -> None:
    """The gateway writes `<key>.pub` unless it is there with the right content: on a read-only Secret
    volume both must be in it, a matching pair."""
    from cryptography.hazmat.primitives import serialization

    from policy.audit.keys import public_pem

    spec = one(rendered, "Deployment", "lockgate-gateway")["spec"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "audit-keys"]
    (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "audit-keys"]
    data = secret_data(rendered, volume["secret"]["secretName"])
    files = {item["path"]: data[item["key"]] for item in volume["secret"]["items"]}
    key_path = Path(config.audit.signing_key_file)
    assert key_path.parent == Path(mount["mountPath"])
    private = serialization.load_pem_private_key(files[key_path.name].encode(), password=None)
    assert public_pem(private.public_key()).decode() == files[key_path.name + ".pub"]  # type: ignore[arg-type]


def test_the_engines_run_the_remote_engines_contract(rendered: list[Doc], config: Config) -> None:
    vllm = one(rendered, "StatefulSet", "vllm")
    service = one(rendered, "Service", "vllm")
    assert vllm["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    args = container(vllm, "vllm")["args"]
    port = int(next(a for a in args if a.startswith("--port=")).split("=", 1)[1])
    assert len(config.engines) == vllm["spec"]["replicas"]
    for ordinal, spec in enumerate(config.engines):
        remote = spec.remote
        assert spec.kind == "vllm_remote"
        assert remote is not None
        url = urlsplit(remote.url)
        assert url.hostname == f"vllm-{ordinal}.{service['metadata']['name']}"
        assert url.port == port
        wanted = server_flags(
            served_model=remote.served_model,
            max_model_len=remote.max_model_len,
            max_num_seqs=remote.max_num_seqs,
            kv_cache_bytes=spec.kv_cache_bytes,
            eager=False,
        )
        missing = [flag for flag in wanted if flag not in args]
        assert not missing, f"the vllm StatefulSet lacks {missing}"
        assert f"--model={Path(config.model.data_dir) / remote.served_model}" in args
    assert any(a.startswith("--dtype=") for a in args)
    # A replica told to stop drains its requests for --shutdown-timeout seconds, then tears down: all
    # before the kubelet's SIGKILL.
    drain = int(next(a for a in args if a.startswith("--shutdown-timeout=")).split("=", 1)[1])
    assert drain > 0
    assert vllm["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= drain + 10


def probe_path(c: Mapping[str, Any], probe: str) -> str:
    return str(c[probe]["httpGet"]["path"])


def test_probes_drain_and_disruption(rendered: list[Doc], config: Config) -> None:
    deployment = one(rendered, "Deployment", "lockgate-gateway")
    pod = deployment["spec"]["template"]
    gateway = container(deployment, "gateway")
    assert probe_path(gateway, "readinessProbe") == "/readyz"
    assert probe_path(gateway, "livenessProbe") == "/healthz"
    (port,) = gateway["ports"]
    assert port["containerPort"] == config.server.port
    # SIGTERM comes after the preStop pause; then the drain, the quota settlements and the audit flush all
    # run before the kubelet's SIGKILL.
    pause = gateway["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = config.server.drain_timeout + config.quota.settle_drain_timeout + config.audit.close_timeout
    needed = pause + drain
    assert pod["spec"]["terminationGracePeriodSeconds"] >= needed
    labels = pod["metadata"]["labels"]
    pdb = one(rendered, "PodDisruptionBudget", "lockgate-gateway")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    monitor = one(rendered, "ServiceMonitor", "lockgate-gateway")
    service = one(rendered, "Service", "lockgate-gateway")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    # GET /metrics needs a key (metrics.require_key): the scrape sends one.
    assert config.metrics.require_key
    assert endpoint["authorization"]["credentials"]["key"]


def test_the_autoscaler_scales_on_a_gauge_the_gateway_exports(rendered: list[Doc]) -> None:
    hpa = one(rendered, "HorizontalPodAutoscaler", "lockgate-gateway")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "lockgate-gateway",
    }
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    # The Prometheus adapter's rule (README "Deploying") renames lockgate:<x> to lockgate_<x>.
    assert name.startswith("lockgate_")
    assert PREFIX + name.removeprefix("lockgate_") in GAUGE_MODES


def test_only_the_gateway_reaches_the_engines_and_stores(rendered: list[Doc]) -> None:
    policy = one(rendered, "NetworkPolicy", "lockgate-backends")
    (expression,) = policy["spec"]["podSelector"]["matchExpressions"]
    assert set(expression["values"]) == {"vllm", "redis", "postgres"}
    (rule,) = policy["spec"]["ingress"]
    (source,) = rule["from"]
    assert source["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "lockgate-gateway"}


def test_the_secrets_step_never_overwrites(tmp_path: Path) -> None:
    assert secrets.main([str(tmp_path)]) == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()} == dict.fromkeys(before, 0o600)
    assert secrets.main([str(tmp_path)]) == 1
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert secrets.main([str(tmp_path), "--force"]) == 0
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} != before
