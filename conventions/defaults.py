"""The defaults that more than one place states, stated once: the pod's, the control plane's and the
router's flags, the ``lorafleet`` command line, ``lorafleet up``, the Dockerfiles' EXPOSE lines and the
chart's values.yaml all agree with these (tests/test_defaults.py fails when one drifts). Where lorafleet keeps
its files (the admin token among them) is in conventions/home.py. Torch-free and import-free."""

from __future__ import annotations

# Address a server listens on unless --host says otherwise, and the host the command line dials:
# loopback, so that a bare server is not reachable from the network. The chart passes --host 0.0.0.0.
HOST = "127.0.0.1"

# The control plane's gRPC port: AdapterAdmin, PodMembership, grpc.health.v1, reflection.
CONTROL_PLANE_PORT = 50051
# The control plane's Prometheus /metrics port.
CONTROL_PLANE_METRICS_PORT = 9100
# A data-plane pod's gRPC port: Generation, DataPlaneAdmin, grpc.health.v1, reflection.
POD_PORT = 50052
# A data-plane pod's Prometheus /metrics port.
POD_METRICS_PORT = 9101
# The router's gRPC port: Generation (forwarded to the pods), grpc.health.v1, reflection.
ROUTER_PORT = 50050
# The router's Prometheus /metrics port.
ROUTER_METRICS_PORT = 9102
# The router's OpenAI-compatible HTTP API: the port OpenAI-compatible servers commonly use.
ROUTER_HTTP_PORT = 8000
# The port of the Redis that `lorafleet up` starts; the chart's Redis listens on the same one.
REDIS_PORT = 6379

# The control plane the admin commands dial without --control-plane or $LORAFLEET_CONTROL_PLANE:
# the one `lorafleet up` starts.
CONTROL_PLANE_ENDPOINT = f"{HOST}:{CONTROL_PLANE_PORT}"
# The pod `lorafleet up` starts; `lorafleet generate --endpoint` names it (or another) to bypass the router.
POD_ENDPOINT = f"{HOST}:{POD_PORT}"
# What `lorafleet generate` dials without --endpoint or $LORAFLEET_ENDPOINT: the router `lorafleet up` starts.
ROUTER_ENDPOINT = f"{HOST}:{ROUTER_PORT}"

# Compute device and precision (--dtype) of a pod, of `lorafleet up`'s pod and of `lorafleet generate --local`.
# The chart passes its own device (cuda) and dtype (auto unless set) as flags, for a GPU node pool.
DEVICE = "cpu"
DTYPE = "auto"
# What --dtype accepts: auto, then every precision of data_plane/model/precision.py, by its name.
DTYPES = ("auto", "float32", "bfloat16", "float16", "bfloat16-matmul")

# Adapter slots on the compute device (--max-loras), preallocated at start-up; `lorafleet up`'s pod too.
MAX_LORAS = 8
# Adapters held in a pod's host-memory cache tier (--max-cpu-loras); at least MAX_LORAS.
MAX_CPU_LORAS = 32
# Largest adapter rank a slot holds (--max-lora-rank); with MAX_LORAS it sizes the slot buffers.
MAX_LORA_RANK = 64
