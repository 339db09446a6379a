"""The registry through the HTTP API, on both deployments: versions on the wire, canary, rollback in one call,
streams that outlive an alias move, bad input, and replicas that see each other's changes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.config import Config, RegistryConfig
from gateway.generation.prompts import PromptRenderer
from policy.auth import SYSTEM_TENANT
from policy.tenants.keys import new_key
from policy.tenants.models import ApiKey, Tenant
from registry.default_model import read_model_dir
from registry.hashing import sha256_file
from registry.store.postgres import PostgresRegistryStore
from tests.backends import DEPLOYMENTS, PG_DSN, Backends, FakeClock, deployment
from tests.conftest import DATA_DIR, MODEL, OutcomeLog, add_key, eventually, make_config, serving

CHAT = "/v1/chat/completions"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class Replica:
    """One gateway app on a deployment, with an operator admin key and a consumer key (and, where a test
    needs keys to split over, more consumer keys of the same tenant)."""

    def __init__(
        self, http: httpx.AsyncClient, admin: str, consumer: str, others: tuple[str, ...] = ()
    ) -> None:
        self.http = http
        self.admin = {"authorization": f"Bearer {admin}"}
        self.consumer = {"authorization": f"Bearer {consumer}"}
        self.consumers = (consumer, *others)

    async def ask(
        self, request_id: str | None = None, model: str = MODEL, key: str | None = None
    ) -> httpx.Response:
        headers = dict(self.consumer) if key is None else {"authorization": f"Bearer {key}"}
        if request_id is not None:
            headers["x-request-id"] = request_id
        body = {"model": model, "messages": QUESTION, "max_tokens": 3}
        return await self.http.post(CHAT, json=body, headers=headers)

    async def served(self, request_id: str | None = None, key: str | None = None) -> str:
        response = await self.ask(request_id, key=key)
        assert response.status_code == 200, response.text
        return response.headers["x-lockgate-model"]

    async def admin_call(self, method: str, path: str, body: Any = None) -> httpx.Response:
        return await self.http.request(
            method, f"/admin/registry/model/{MODEL}{path}", json=body, headers=self.admin
        )


def config(refresh_interval: float = 1.0) -> Config:
    return msgspec.structs.replace(make_config(), registry=RegistryConfig(refresh_interval=refresh_interval))


async def keys(backends: Backends, clock: FakeClock) -> tuple[str, str]:
    for tenant_id in ("acme", SYSTEM_TENANT):
        await backends.tenants.create_tenant(
            Tenant(tenant_id=tenant_id, display_name=tenant_id), actor="t", now=clock()
        )
    admin = await add_key(backends.tenants, SYSTEM_TENANT, ("policy_admin",), now=clock())
    consumer = await add_key(backends.tenants, "acme", ("consumer",), now=clock())
    return admin, consumer


async def more_consumers(backends: Backends, clock: FakeClock, count: int) -> tuple[str, ...]:
    """`count` more consumer keys of `acme` (a model canary splits API keys, not requests)."""
    return tuple([await add_key(backends.tenants, "acme", ("consumer",), now=clock()) for _ in range(count)])


@pytest.fixture(params=DEPLOYMENTS)
async def backends(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backends]:
    async with deployment(request.param, tmp_path) as stores:
        yield stores


@pytest.fixture
async def replica(
    backends: Backends, sim_engine: SimulatedEngine, renderer: PromptRenderer, outcomes: OutcomeLog
) -> AsyncIterator[Replica]:
    clock = FakeClock()
    admin, consumer = await keys(backends, clock)
    others = await more_consumers(backends, clock, 29)
    app = create_app(
        config(),
        engine=sim_engine,
        renderer=renderer,
        tenants=backends.tenants,
        quota=backends.quota,
        registry=backends.registry,
        clock=clock,
        sink=outcomes,
    )
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        yield Replica(http, admin, consumer, others)


async def publish_v2(replica: Replica) -> tuple[str, str]:
    """Publish a second version of the default model (same files, tokenizer and template, named by an
    absolute artifact path: a version's files must exist to be published); return (v1, v2) refs."""
    v1 = await replica.served()
    [current] = (await replica.admin_call("GET", "/versions")).json()
    spec = dict(current["spec"], artifact=str(DATA_DIR / current["spec"]["artifact"]))
    created = await replica.admin_call("POST", "/versions", {"version": "v2", "spec": spec})
    assert created.status_code == 201, created.text
    assert created.json()["ref"] == f"{MODEL}@v2"
    assert len(created.json()["content_hash"]) == 64
    return v1, f"{MODEL}@v2"


async def test_versions_on_the_wire_canary_and_one_call_rollback(
    replica: Replica, outcomes: OutcomeLog
) -> None:
    v1, v2 = await publish_v2(replica)
    # Publishing adds a version; the alias still serves v1. Pinning name@version bypasses the alias.
    assert await replica.served() == v1
    pinned = await replica.ask(model=v2)
    assert pinned.headers["x-lockgate-model"] == v2
    outcome = await outcomes.wait_for(pinned.headers["x-request-id"])
    assert outcome.model == v2
    assert outcome.tokenizer.startswith(f"{MODEL}@")
    assert outcome.chat_template.startswith(f"{MODEL}@")

    canary = await replica.admin_call(
        "PUT",
        "/alias",
        {"targets": [{"version": v1.split("@")[1], "weight": 0.5}, {"version": "v2", "weight": 0.5}]},
    )
    assert canary.status_code == 200, canary.text
    # Deterministic per API key: whatever request id a key sends, a retry included, one version serves it
    # (tests/gateway/test_canary_key.py); the keys split between the versions.
    for key in replica.consumers[:3]:
        first = await replica.served(key=key)
        assert {await replica.served(f"retry-{i}", key=key) for i in range(3)} == {first}
    assert {await replica.served(key=key) for key in replica.consumers} == {v1, v2}
    listed = (await replica.http.get("/v1/models", headers=replica.consumer)).json()["data"]
    [alias] = [m for m in listed if m["id"] == MODEL]
    assert {t["model"] for t in alias["targets"]} == {v1, v2}

    assert (await replica.admin_call("PUT", "/alias", {"targets": [{"version": "v2"}]})).status_code == 200
    assert {await replica.served(f"all-{i}") for i in range(5)} == {v2}
    # One call undoes the bad rollout: back to the canary; another, back to v1 alone.
    assert (await replica.admin_call("POST", "/rollback")).status_code == 200
    assert {await replica.served(key=key) for key in replica.consumers} == {v1, v2}
    assert (await replica.admin_call("POST", "/rollback")).status_code == 200
    assert {await replica.served(f"spread-{i}") for i in range(10)} == {v1}
    history = (await replica.admin_call("GET", "/history")).json()
    assert [h["action"] for h in history[:4]] == ["rollback", "rollback", "set", "set"]


async def test_bad_registry_input_is_a_4xx_naming_the_problem(replica: Replica) -> None:
    v1, _ = await publish_v2(replica)
    [first, _second] = (await replica.admin_call("GET", "/versions")).json()
    changed = dict(first["spec"], artifact="elsewhere/model.safetensors")
    conflict = await replica.admin_call("POST", "/versions", {"version": first["version"], "spec": changed})
    assert conflict.status_code == 409
    assert first["version"] in conflict.json()["error"]["message"]
    # The same content again is fine (idempotent).
    again = await replica.admin_call(
        "POST", "/versions", {"version": first["version"], "spec": first["spec"]}
    )
    assert again.status_code == 201
    assert again.json()["content_hash"] == first["content_hash"]

    missing = await replica.admin_call("PUT", "/alias", {"targets": [{"version": "nope"}]})
    assert missing.status_code in (400, 404)
    assert "nope" in missing.json()["error"]["message"]
    uneven = [{"version": "v2", "weight": 0.7}, {"version": first["version"], "weight": 0.2}]
    bad_weights = await replica.admin_call("PUT", "/alias", {"targets": uneven})
    assert bad_weights.status_code == 400
    assert "1" in bad_weights.json()["error"]["message"]
    no_tokenizer = dict(first["spec"], tokenizer=f"{MODEL}@missing")
    refused = await replica.admin_call("POST", "/versions", {"version": "v3", "spec": no_tokenizer})
    assert refused.status_code in (400, 404)
    assert "missing" in refused.json()["error"]["message"]
    typo = await replica.admin_call(
        "POST", "/versions", {"version": "v4", "spec": dict(first["spec"], layers=3)}
    )
    assert typo.status_code == 400
    assert typo.json()["error"]["param"] == "spec"
    # Nothing of that changed what is served.
    assert await replica.served() == v1
    unknown = await replica.ask(model=f"{MODEL}@nope")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["param"] == "model"


async def test_a_stream_started_before_an_alias_move_finishes_on_its_version(
    replica: Replica, outcomes: OutcomeLog
) -> None:
    v1, v2 = await publish_v2(replica)
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 300, "stream": True}
    async with replica.http.stream("POST", CHAT, json=body, headers=replica.consumer) as response:
        assert response.headers["x-lockgate-model"] == v1
        lines = response.aiter_lines()
        assert (await anext(lines)).startswith("data: ")
        moved = await replica.admin_call("PUT", "/alias", {"targets": [{"version": "v2"}]})
        assert moved.status_code == 200
        assert await replica.served() == v2
        rest = [line async for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    outcome = await outcomes.wait_for(response.headers["x-request-id"])
    assert (outcome.status, outcome.model, outcome.usage.completion_tokens) == ("completed", v1, 300)


async def test_two_replicas_on_one_postgresql_see_each_others_changes(
    tmp_path: Path, sim_engine: SimulatedEngine, renderer: PromptRenderer, outcomes: OutcomeLog
) -> None:
    async with deployment("redis+postgres", tmp_path) as backends:
        await _two_replicas(backends, sim_engine, renderer, outcomes)


async def _two_replicas(
    backends: Backends, sim_engine: SimulatedEngine, renderer: PromptRenderer, outcomes: OutcomeLog
) -> None:
    clock = FakeClock()
    admin, consumer = await keys(backends, clock)
    others = await more_consumers(backends, clock, 15)
    interval = 0.05
    # Replica B opens a registry store of its own on the same schema, as another process would.
    other_store = await PostgresRegistryStore.open(PG_DSN, schema=backends.schema)
    apps = [
        create_app(
            config(interval),
            engine=sim_engine,
            renderer=renderer,
            tenants=backends.tenants,
            quota=backends.quota,
            registry=store,
            clock=clock,
            sink=outcomes,
        )
        for store in (backends.registry, other_store)
    ]
    async with (
        serving(apps[0]) as url_a,
        serving(apps[1]) as url_b,
        httpx.AsyncClient(base_url=url_a, timeout=30) as http_a,
        httpx.AsyncClient(base_url=url_b, timeout=30) as http_b,
    ):
        a, b = Replica(http_a, admin, consumer, others), Replica(http_b, admin, consumer, others)
        v1, v2 = await publish_v2(a)
        assert await b.served() == v1
        assert (await a.admin_call("PUT", "/alias", {"targets": [{"version": "v2"}]})).status_code == 200
        assert await a.served() == v2  # at once on the replica that made the change

        async def b_serves_v2() -> bool:
            return await b.served() == v2

        # Within the refresh interval (plus one snapshot read) on the other; a generous limit for a busy CI.
        await eventually(b_serves_v2, within=interval * 100)

        # In a canary the replicas agree on every key's version: the secret that keys the pick was generated
        # by the first to start and stored in the shared database, and the other read it from there.
        assert apps[0].state.services.secret.model_key("acme", "k") == apps[
            1
        ].state.services.secret.model_key("acme", "k")
        canary = [{"version": v1.split("@")[1], "weight": 0.5}, {"version": "v2", "weight": 0.5}]
        assert (await a.admin_call("PUT", "/alias", {"targets": canary})).status_code == 200

        async def b_splits() -> bool:
            return {await b.served(key=key) for key in b.consumers} == {v1, v2}

        await eventually(b_splits, within=interval * 100)
        assert [await a.served(key=key) for key in a.consumers] == [
            await b.served(key=key) for key in b.consumers
        ]
    await other_store.close()


async def test_tenants_bind_to_a_policy_alias_or_a_pinned_version_that_resolves(replica: Replica) -> None:
    async def create(tenant_id: str, policy: str) -> httpx.Response:
        body = {"tenant_id": tenant_id, "display_name": tenant_id, "policy": policy}
        return await replica.http.post("/admin/tenants", json=body, headers=replica.admin)

    follows = await create("follows", "default")
    assert follows.status_code == 201, follows.text
    assert (await create("pinned", "default@1")).status_code == 201
    for policy in ("nope", "default@7"):
        refused = await create(f"bad-{policy.replace('@', '-')}", policy)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert (error["param"], error["code"]) == ("policy", "unknown_policy")
    patched = await replica.http.patch(
        "/admin/tenants/pinned", json={"policy": "nope"}, headers=replica.admin
    )
    assert patched.status_code == 400
    versions = await replica.http.get("/admin/registry/policy/default/versions", headers=replica.admin)
    # The built-in versions: no guard stages (what tenants had before the cascade) and the rules stage alone.
    listed = {v["ref"]: v["spec"]["stages"] for v in versions.json()}
    assert listed["default@1"] == []
    assert [stage["kind"] for stage in listed["default@rules-1"]] == ["rules"]


MANIFEST = """
[[tokenizer]]
name = "tiny"
version = "t1"
content_hash = "%(tokenizer)s"

[[chat_template]]
name = "tiny"
version = "c1"
text = "{%% for m in messages %%}{{ m.content }}{%% endfor %%}"

[[model]]
name = "tiny"
version = "1"
artifact = "%(artifact)s"
weights_sha256 = "%(hash)s"
tokenizer = "tiny@t1"
chat_template = "tiny@c1"
engine_pool = "default"
arch = { layers = 2, kv_heads = 1, head_dim = 8, kv_dtype_bytes = 2, max_context = 512 }

[[alias]]
kind = "model"
name = "tiny"
targets = [{ version = "1", weight = 1.0 }]
"""


async def test_a_manifest_is_applied_at_start_up_idempotently(
    backends: Backends,
    tmp_path: Path,
    model_dir: Path,
    sim_engine: SimulatedEngine,
    renderer: PromptRenderer,
    outcomes: OutcomeLog,
) -> None:
    manifest = tmp_path / "registry.toml"
    # A model version's files must exist and match its tokenizer version, and a replica must serve its
    # weights: the prepared model's (the simulated replica serves the configured model's weights).
    files = {
        "hash": read_model_dir(model_dir).weights_sha256,
        "tokenizer": sha256_file(model_dir / "tokenizer.json"),
        "artifact": str(model_dir / "model.safetensors"),
    }
    manifest.write_text(MANIFEST % files, encoding="utf-8")
    clock = FakeClock()
    admin, consumer = await keys(backends, clock)
    conf = msgspec.structs.replace(make_config(), registry=RegistryConfig(manifest=str(manifest)))
    for _restart in range(2):
        app = create_app(
            conf,
            engine=sim_engine,
            renderer=renderer,
            tenants=backends.tenants,
            quota=backends.quota,
            registry=backends.registry,
            clock=clock,
            sink=outcomes,
        )
        async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
            replica = Replica(http, admin, consumer)
            answer = await replica.ask(model="tiny")
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-lockgate-model"] == "tiny@1"
            models = (await http.get("/v1/models", headers=replica.consumer)).json()["data"]
            [tiny] = [m for m in models if m["id"] == "tiny@1"]
            assert tiny["kv_bytes_per_token"] == 2 * 2 * 1 * 8 * 2
            history = await http.get("/admin/registry/model/tiny/history", headers=replica.admin)
            # The second start changed nothing: still one alias change.
            assert len(history.json()) == 1


BETA_POLICY = {
    "categories": [{"name": "secrets", "severity": "high"}],
    "stages": [
        {"kind": "rules", "allow_below": 0.1, "block_above": 0.9},
        {"kind": "model", "guard": "beta-guard@1", "allow_below": 0.2, "block_above": 0.8},
    ],
    "past_last_stage": "block",
    "fail_modes": {"secrets": "closed"},
    "hold_back_tokens": 0,
    "retention": "hash",
    "rules": {"block": [{"category": "secrets", "pattern": "beta-secret-term"}]},
}
BETA_GUARD = {
    "kind": "embedding",
    "artifact": "beta-guard-dir",
    "weights_sha256": "ab" * 32,
    "prompt_template": "beta guard prompt text",
}


async def test_a_tenants_admin_reads_only_what_its_tenant_is_bound_to(
    replica: Replica, backends: Backends
) -> None:
    # Any tenant's policy_admin once read the whole registry: other tenants' block patterns, thresholds,
    # guard prompts and canary splits.
    http, operator = replica.http, replica.admin
    # Forced: beta-guard has no files, so the publish check cannot measure beta-policy (test_publish_check).
    forcer = await add_key(backends.tenants, SYSTEM_TENANT, ("policy_admin", "operator"))
    forcing = {"authorization": f"Bearer {forcer}"}

    async def publish(kind: str, name: str, version: str, spec: dict[str, Any]) -> None:
        body = {"version": version, "spec": spec, "force": True}
        response = await http.post(f"/admin/registry/{kind}/{name}/versions", json=body, headers=forcing)
        assert response.status_code == 201, response.text

    await publish("guard_model", "beta-guard", "1", BETA_GUARD)
    await publish("policy", "beta-policy", "1", BETA_POLICY)
    await publish("policy", "beta-policy", "2", {**BETA_POLICY, "hold_back_tokens": 7})
    await publish("prompt", "beta-prompt", "1", {"text": "beta instructions"})
    await publish("prompt", "acme-key-prompt", "1", {"text": "acme key instructions"})
    split = {"targets": [{"version": "1", "weight": 0.9}, {"version": "2", "weight": 0.1}]}
    moved = await http.put("/admin/registry/policy/beta-policy/alias", json=split, headers=operator)
    assert moved.status_code == 200, moved.text
    only = {"targets": [{"version": "1", "weight": 1.0}]}
    assert (
        await http.put("/admin/registry/prompt/beta-prompt/alias", json=only, headers=operator)
    ).is_success
    beta = {
        "tenant_id": "beta",
        "display_name": "Beta",
        "policy": "beta-policy",
        "system_prompt": "beta-prompt",
    }
    assert (await http.post("/admin/tenants", json=beta, headers=operator)).status_code == 201
    admins: dict[str, dict[str, str]] = {}
    for tenant in ("acme", "beta"):
        plaintext = await add_key(backends.tenants, tenant, ("policy_admin",))
        admins[tenant] = {"authorization": f"Bearer {plaintext}"}
    # A prompt the operator set on one of acme's keys is acme's to read.
    _plain, key_id, secret_hash = new_key()
    key = ApiKey(key_id=key_id, tenant_id="acme", roles=("consumer",), system_prompt="acme-key-prompt@1")
    await backends.tenants.add_key(key, secret_hash, actor="t", now=0.0)

    async def read(who: dict[str, str], path: str) -> Any:
        response = await http.get(f"/admin/registry/{path}", headers=who)
        assert response.status_code == 200, response.text
        if who is admins["acme"]:
            for secret in ("beta-secret-term", "beta guard prompt", "beta instructions", "beta-policy"):
                assert secret not in response.text
        return response.json()

    beta_entries = [
        "policy/beta-policy",
        "policy/beta-policy@1",
        "guard_model/beta-guard",
        "prompt/beta-prompt",
    ]
    for entry in beta_entries:
        # Exactly as a name nobody published.
        assert await read(admins["acme"], f"{entry}/versions") == []
        assert await read(admins["acme"], f"{entry}/history") == []
        assert await read(admins["acme"], f"{entry}/versions") == await read(
            admins["acme"], "policy/nope/versions"
        )
    visible = {(a["kind"], a["name"]) for a in await read(admins["acme"], "aliases")}
    assert ("policy", "beta-policy") not in visible
    assert ("prompt", "beta-prompt") not in visible
    assert await read(admins["acme"], "aliases?kind=policy") == [
        a for a in await read(operator, "aliases?kind=policy") if a["name"] == "default"
    ]
    # Its own policy, its key's prompt and the model catalogue it reads.
    assert await read(admins["acme"], "policy/default/versions")
    assert [v["ref"] for v in await read(admins["acme"], "prompt/acme-key-prompt/versions")] == [
        "acme-key-prompt@1"
    ]
    assert await read(admins["acme"], f"model/{MODEL}/versions") == await read(
        operator, f"model/{MODEL}/versions"
    )
    assert ("model", MODEL) in visible

    # Beta's admin reads beta's policy (both versions, the split), its guard and prompt, and not acme's.
    assert [v["ref"] for v in await read(admins["beta"], "policy/beta-policy/versions")] == [
        "beta-policy@1",
        "beta-policy@2",
    ]
    assert [v["ref"] for v in await read(admins["beta"], "guard_model/beta-guard/versions")] == [
        "beta-guard@1"
    ]
    assert await read(admins["beta"], "prompt/beta-prompt/history")
    assert await read(admins["beta"], "policy/default/versions") == []
    assert await read(admins["beta"], "prompt/acme-key-prompt/versions") == []
    beta_aliases = {(a["kind"], a["name"]) for a in await read(admins["beta"], "aliases")}
    assert {("policy", "beta-policy"), ("prompt", "beta-prompt")} <= beta_aliases
    assert ("policy", "default") not in beta_aliases
    # The operator reads everything; a consumer key reads nothing.
    assert len(await read(operator, "policy/beta-policy/versions")) == 2
    assert await read(operator, "guard_model/beta-guard/versions")
    refused = await http.get("/admin/registry/aliases", headers=replica.consumer)
    assert refused.status_code == 403
