"""The prefix-workload simulator: every request is served, what it counts adds up, the same seed gives the
same run, and the router's prefix term finds more of the prompts cached when they outnumber what one pod's
KV cache holds (the claim benchmarks/prefix_routing.py measures at scale)."""

from __future__ import annotations

from fleetsim.prefix_fleet import PrefixFleet, PrefixSimulation, PrefixWorkload, make_requests

# 4 pods of 256 blocks x 16 tokens (4k tokens); 2 adapters x 16 system prompts of 256 tokens (8k tokens in
# all, besides the running requests' own blocks): every prompt fits in the fleet, not in one pod.
FLEET = PrefixFleet(pods=4, max_num_seqs=8, num_kv_blocks=256, prefill_budget=512)
WORKLOAD = PrefixWorkload(adapters=2, system_prompts=16, system_tokens=256, user_tokens=(16, 48),
                          output_tokens=(8, 32), rate=40.0, duration_s=20.0, warmup_s=5.0, seed=3)


def test_every_request_is_served_and_counted():
    result = PrefixSimulation(FLEET, WORKLOAD, 0.0).run()
    requests = make_requests(WORKLOAD)
    counted = [r for r in requests if r.arrival >= WORKLOAD.warmup_s]
    assert result.requests == result.completed == len(counted) > 0
    assert 0.0 <= result.hit_rate < 1.0
    mean_prompt = sum(len(r.prompt) for r in counted) / len(counted)
    assert abs(result.prefill_tokens_per_request - mean_prompt * (1 - result.hit_rate)) < 1e-6
    assert result.ttft_p50_ms <= result.ttft_p99_ms and result.ttft_p50_ms <= result.e2e_p50_ms
    assert result.routed_to_holder == 0.0  # blind to prefixes, the router never looks


def test_the_same_seed_gives_the_same_run():
    assert PrefixSimulation(FLEET, WORKLOAD, 10.0).run() == PrefixSimulation(FLEET, WORKLOAD, 10.0).run()


def test_routing_by_reported_prefixes_finds_more_of_the_prompts_cached():
    blind = PrefixSimulation(FLEET, WORKLOAD, 0.0).run()
    aware = PrefixSimulation(FLEET, WORKLOAD, 10.0).run()
    assert aware.routed_to_holder > 0.5
    assert aware.hit_rate > blind.hit_rate + 0.05
    assert aware.prefill_tokens_per_request < blind.prefill_tokens_per_request
