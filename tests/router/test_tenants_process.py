"""Tenants on a real router process in front of the real fleet of tests/router/conftest.py, with the fleet's
own redis-server counting limits: the official ``openai`` client on the HTTP door and grpc stubs on the gRPC
door. A key calls its tenant's adapters and nothing else, lists only those, stops working within a poll of
the file being rewritten, is refused over its limits with the wait and let in again after it; each request
leaves its usage in the router's metrics and log; an HTTP timeout becomes the pod's deadline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import openai
import pytest

from benchmarks.processes import FLEET_BASE_MODEL, RouterProcess, wait_until
from conventions.status import retry_after_s
from router.tenants import key_hash
from tests.grpc_helpers import request

pytestmark = pytest.mark.slow
PIRATES, SHOUTERS, HASTY, THRIFTY = "sk-pirates", "sk-shouters", "sk-hasty", "sk-thrifty"
REPO = Path(__file__).resolve().parents[2]


def tenants(*revoked: str) -> str:
    entry = lambda name, key, **more: {"name": name, "key_sha256": [key_hash(key)], **more} if key not in revoked \
        else {"name": name, "key_sha256": [key_hash(key + "-revoked")], **more}
    return json.dumps({"tenants": [
        entry("pirates", PIRATES, adapters=["pirate"]),
        entry("shouters", SHOUTERS, adapters=["shout*"], base_model=True),
        entry("hasty", HASTY, adapters=["*"], base_model=True, requests_per_second=0.2),
        entry("thrifty", THRIFTY, base_model=True, tokens_per_minute=6),
    ]})


@pytest.fixture(scope="module")
def guarded(stack, tmp_path_factory):
    """(router with --tenants-file, the tenants file) in front of the package's fleet."""
    fleet, _, _ = stack
    workdir = tmp_path_factory.mktemp("tenants-router")
    path = workdir / "tenants.json"
    path.write_text(tenants())
    router = RouterProcess(workdir, fleet.cp.target, fleet.token_file, "--refresh-interval", "0.3",
                           "--tenants-file", str(path), "--keys-reload-interval", "0.2",
                           "--limits-redis-url", fleet.redis.url).start()
    wait_until(lambda: _models(router, SHOUTERS), 20, "the router's first read of the fleet")
    yield router, path
    router.stop()


def client(router: RouterProcess, key: str, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url, api_key=key, max_retries=0, timeout=120,
                         default_headers=headers or None)


def _models(router: RouterProcess, key: str) -> list[str]:
    with client(router, key) as c:
        return [m.id for m in c.models.list()]


def chat(router: RouterProcess, key: str, model: str, **kwargs):
    with client(router, key) as c:
        return c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Ahoy?"}],
                                         max_tokens=kwargs.pop("max_tokens", 2), temperature=0, **kwargs)


def generate(router: RouterProcess, key: str | None, adapter: str):
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    return list(router.generation().Generate(request("Ahoy?", adapter, max_tokens=2), timeout=120,
                                             metadata=metadata))


def grpc_code(router: RouterProcess, key: str | None, adapter: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        generate(router, key, adapter)
    return e.value


def test_a_key_calls_its_own_adapters_and_no_other_tenants_on_both_doors(guarded):
    router, _ = guarded
    assert chat(router, PIRATES, "pirate").usage.completion_tokens == 2
    assert chat(router, SHOUTERS, "shouty").usage.completion_tokens == 2
    assert generate(router, PIRATES, "pirate")[-1].usage.completion_tokens == 2
    assert generate(router, SHOUTERS, "")[-1].usage.completion_tokens == 2
    refusals = {}
    for model in ("shouty", "no-such-adapter", FLEET_BASE_MODEL):  # another's, absent, and the base model
        with pytest.raises(openai.PermissionDeniedError) as e:
            chat(router, PIRATES, model)
        refusals[model] = e.value.message.replace(repr(model), "M")
        adapter = "" if model == FLEET_BASE_MODEL else model
        assert grpc_code(router, PIRATES, adapter).code() == grpc.StatusCode.PERMISSION_DENIED
    # The same words for an adapter that exists and one that does not: nothing says which is which.
    assert refusals["shouty"] == refusals["no-such-adapter"]
    for key in (None, "sk-nobody"):
        assert grpc_code(router, key, "pirate").code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(openai.AuthenticationError):
        chat(router, "sk-nobody", "pirate")


def test_models_lists_only_what_the_key_may_use(guarded):
    router, _ = guarded
    assert _models(router, PIRATES) == ["pirate"]
    assert _models(router, SHOUTERS) == [FLEET_BASE_MODEL, "shouty"]
    assert _models(router, HASTY) == [FLEET_BASE_MODEL, "pirate", "shouty", "signoff"]


def test_a_revoked_key_stops_working_within_seconds_and_a_new_file_needs_no_restart(guarded):
    router, path = guarded
    pid = router.proc.pid
    assert chat(router, SHOUTERS, "shouty").usage.completion_tokens == 2
    _replace(path, tenants(SHOUTERS))
    try:
        wait_until(lambda: _refused(router, SHOUTERS), 5, "the revoked key refused")
        assert grpc_code(router, SHOUTERS, "shouty").code() == grpc.StatusCode.UNAUTHENTICATED
        assert chat(router, PIRATES, "pirate").usage.completion_tokens == 2  # the other keys unchanged
        _replace(path, "{not json")  # a broken file keeps the last good one in use
        time.sleep(0.6)
        assert chat(router, PIRATES, "pirate").usage.completion_tokens == 2
    finally:
        _replace(path, tenants())
    wait_until(lambda: not _refused(router, SHOUTERS), 5, "the key restored")
    assert router.proc.pid == pid and router.proc.poll() is None


def test_over_its_requests_per_second_a_tenant_gets_429_and_the_pushback_then_gets_in(guarded):
    router, _ = guarded
    assert chat(router, HASTY, "shouty").usage.completion_tokens == 2  # its first: one every 5 s
    with client(router, HASTY) as c, pytest.raises(openai.RateLimitError) as e:
        c.chat.completions.create(model="shouty", messages=[{"role": "user", "content": "Ahoy?"}], max_tokens=2)
    assert 1 <= int(e.value.response.headers["Retry-After"]) <= 5 and "0.2 requests/s" in e.value.message
    refused = grpc_code(router, HASTY, "shouty")
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert 0 < retry_after_s(refused.trailing_metadata()) <= 5
    time.sleep(retry_after_s(refused.trailing_metadata()) + 0.05)
    assert generate(router, HASTY, "shouty")[-1].usage.completion_tokens == 2


def test_over_its_tokens_per_minute_a_tenant_waits_for_what_it_spent(guarded):
    router, _ = guarded
    spent, refusal = 0, None
    # A request's tokens (more than its 6 a minute) are charged as it ends, in the background: a request sent
    # before they are counted still gets in, and spends more.
    for _ in range(5):
        try:
            spent += chat(router, THRIFTY, FLEET_BASE_MODEL).usage.total_tokens
        except openai.RateLimitError as e:
            refusal = e
            break
    assert refusal is not None and spent > 6
    wait = int(refusal.response.headers["Retry-After"])
    assert "6 tokens/min" in refusal.message
    # 10 s a token at 6 a minute, less the minute it may run ahead: what was spent beyond 6 tokens, less the
    # few seconds the requests took.
    assert (spent - 6) * 10 - 15 <= wait <= (spent - 6) * 10 + 1


def test_each_request_leaves_its_usage_in_the_metrics_and_one_log_record(guarded):
    router, _ = guarded
    labels = {"adapter": "shouty", "tenant": "shouters"}  # in the order /metrics writes them
    before = [router.metric(f"lorafleet_router_tenant_{n}_total", **labels) for n in ("prompt_tokens",
                                                                                     "completion_tokens")]
    ok = router.metric("lorafleet_router_tenant_requests_total", adapter="shouty", outcome="OK", tenant="shouters")
    usage = chat(router, SHOUTERS, "shouty", max_tokens=3).usage
    after = [router.metric(f"lorafleet_router_tenant_{n}_total", **labels) for n in ("prompt_tokens",
                                                                                    "completion_tokens")]
    assert [a - b for a, b in zip(after, before, strict=True)] == [usage.prompt_tokens, usage.completion_tokens]
    assert router.metric("lorafleet_router_tenant_requests_total", adapter="shouty", outcome="OK",
                         tenant="shouters") == ok + 1
    denied = router.metric("lorafleet_router_tenant_requests_total", adapter="shouty", outcome="PERMISSION_DENIED",
                           tenant="pirates")
    assert denied >= 2  # the refusals of the first test, on both doors
    records = [json.loads(line) for line in router.log_path.read_text().splitlines() if '"usage"' in line]
    mine = [r for r in records if r.get("tenant") == "shouters" and r.get("completion_tokens") == 3]
    assert mine and mine[-1]["prompt_tokens"] == usage.prompt_tokens and mine[-1]["outcome"] == "OK"
    assert mine[-1]["door"] == "http" and mine[-1]["ttft_s"] > 0 and mine[-1]["adapter"] == "shouty"


def test_an_http_timeout_becomes_the_pods_deadline(stack, guarded):
    fleet, _, _ = stack
    router, _ = guarded
    pods = [pod for pod in fleet.pods.values() if pod.proc.poll() is None]
    aborted = sum(pod.metric("lorafleet_requests_total", outcome="aborted") for pod in pods)
    long = {"model": FLEET_BASE_MODEL, "prompt": "Count to a thousand:", "max_tokens": 500}
    with client(router, SHOUTERS) as c:
        for header, field in (({"X-Request-Timeout": "0.5"}, {}), ({}, {"timeout": 0.5})):
            with pytest.raises(openai.InternalServerError) as e:
                c.completions.create(**long, extra_headers=header, extra_body={"ignore_eos": True, **field})
            assert e.value.status_code == 504 and e.value.code == "deadline_exceeded"
        wait_until(lambda: sum(pod.metric("lorafleet_requests_total", outcome="aborted") for pod in pods)
                   == aborted + 2, 10, "both requests ended on the pod by the deadline")
        wait_until(lambda: not any(pod.state().running_requests for pod in pods), 10, "the pods' requests freed")
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(**long, extra_headers={"X-Request-Timeout": "soon"})
        assert e.value.param == "X-Request-Timeout"


def _refused(router: RouterProcess, key: str, error=openai.AuthenticationError):
    try:
        chat(router, key, FLEET_BASE_MODEL)
    except error as e:
        return e
    return None


def _replace(path, text: str) -> None:
    """Rewrites the file in one rename, as a Kubernetes Secret volume swaps its files."""
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_lorafleet_generate_sends_the_key_from_its_flag_or_the_environment(guarded):
    router, _ = guarded
    cli = [sys.executable, "-m", "cli.main", "generate", "--endpoint", router.address, "--adapter", "pirate",
           "--max-tokens", "4", "Where is the treasure?"]
    env = {k: v for k, v in os.environ.items() if k != "LORAFLEET_API_KEY"}
    run = lambda argv, **more: subprocess.run(argv, cwd=REPO, env={**env, **more}, capture_output=True, text=True,
                                              timeout=120)
    refused = run(cli)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr and "LORAFLEET_API_KEY" in refused.stderr
    assert run(cli, LORAFLEET_API_KEY=PIRATES).stdout.strip()
    assert run([*cli, "--api-key", PIRATES]).stdout.strip()
    denied = run(cli, LORAFLEET_API_KEY=SHOUTERS)  # a key of a tenant that may not use the adapter
    assert denied.returncode == 1 and "PERMISSION_DENIED" in denied.stderr


def test_a_tenant_finds_its_own_cached_prompt_and_none_of_anothers(stack, guarded):
    fleet, _, _ = stack
    router, _ = guarded
    prompt = "Summarise our freight terms: " + "parcels under thirty kilograms go by ferry, heavier ones by ship; " * 10
    # the pods still running: an earlier test of the package may have stopped one of the fleet's
    hits = lambda: sum(pod.metric("lorafleet_prefix_cache_hit_tokens_total") for pod in fleet.pods.values()
                       if pod.proc.poll() is None)

    def ask(key: str) -> None:
        for _ in range(3):  # hasty's 0.2 requests/s may still count an earlier test's request
            try:
                with client(router, key) as c:
                    c.chat.completions.create(model="shouty", messages=[{"role": "user", "content": prompt}],
                                              max_tokens=1, temperature=0)
                return
            except openai.RateLimitError:
                time.sleep(5)
        raise AssertionError(f"{key} stayed rate-limited")

    ask(SHOUTERS)
    before = hits()
    ask(HASTY)  # another tenant, the same prompt and adapter: none of the shouters' blocks
    other = hits() - before
    ask(SHOUTERS)  # the shouters again: their own blocks, the whole prompt's
    own = hits() - before - other
    # hasty finds at most the opening of the chat template, which its own earlier chats cached in its scope
    assert own >= 128 and other <= 32, (own, other)
