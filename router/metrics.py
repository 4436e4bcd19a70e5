"""Every Prometheus metric of the router process, in one registry per server."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# Router-side time to first token: the pod's own TTFT plus routing, retries and two hops.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RouterMetrics:
    """Recorded at request and state-refresh boundaries. ``adapter_class`` is ``base`` or ``adapter``
    (``unknown`` for bytes that are not a GenerateRequest);
    ``outcome`` is the call's gRPC status code name; ``decision`` is base, device_hit, cpu_hit or cold."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("lorafleet_router_requests", "Generate requests by adapter class and outcome",
                                ["adapter_class", "outcome"], registry=r)
        self.decisions = Counter("lorafleet_router_routing_decisions",
                                 "Pods chosen, by what the choice implies for the adapter", ["decision"], registry=r)
        self.prefix_decisions = Counter("lorafleet_router_prefix_decisions",
                                        "Pods chosen for requests of at least one routing-prefix chunk, by how much "
                                        "of the prefix the pod reported holding: all, part or none", ["held"],
                                        registry=r)
        self.ttft = Histogram("lorafleet_router_time_to_first_token_seconds",
                              "Time from a request's arrival at the router to its first message from a pod",
                              ["adapter_class"], buckets=_TTFT_BUCKETS, registry=r)
        self.retries = Counter("lorafleet_router_retries",
                               "Requests sent to another pod after one refused them, by the refusal's code",
                               ["code"], registry=r)
        self.http_responses = Counter("lorafleet_router_http_responses",
                                      "OpenAI-compatible HTTP API responses by route and HTTP status",
                                      ["route", "status"], registry=r)
        self.state_read_failures = Counter("lorafleet_router_state_read_failures",
                                           "Failed reads of fleet state, by source (control_plane or pod)",
                                           ["source"], registry=r)
        # Usage to bill: ``tenant`` is the key's tenant ("none" when the router asks for no key), ``adapter``
        # the adapter's name ("" = base model reads "base").
        usage = ["tenant", "adapter"]
        self.tenant_requests = Counter("lorafleet_router_tenant_requests", "Requests by tenant, adapter and outcome",
                                       [*usage, "outcome"], registry=r)
        self.tenant_prompt_tokens = Counter("lorafleet_router_tenant_prompt_tokens",
                                            "Prompt tokens of finished requests, by tenant and adapter", usage,
                                            registry=r)
        self.tenant_completion_tokens = Counter("lorafleet_router_tenant_completion_tokens",
                                                "Completion tokens sent, by tenant and adapter", usage, registry=r)
        self.limits_store_errors = Counter("lorafleet_router_limits_store_errors",
                                           "Requests let through unlimited because the limits store failed",
                                           registry=r)
        self.pods_routable = Gauge("lorafleet_router_pods_routable", "Pods ready, serving and read", registry=r)
        self.disk_copies = Gauge("lorafleet_router_disk_tier_copies",
                                 "Copies of registered remote adapters on the routable pods' disk tiers, as last read",
                                 registry=r)
        self.adapters_registered = Gauge("lorafleet_router_adapters_registered", "Adapters in the registry",
                                         registry=r)

    def serve(self, port: int, host: str) -> None:
        """Serves /metrics on ``host:port`` from a background thread."""
        start_http_server(port, addr=host, registry=self.registry)
