"""The data-plane pod's configuration: built once from flags, frozen, validated."""

from __future__ import annotations

import argparse
import math
import socket
from dataclasses import dataclass
from pathlib import Path

from conventions import defaults
from conventions.flag_help import DefaultsShown
from conventions.names import NAME_RULE, is_valid_name
from conventions.tls import Dialer, TlsFiles, read_certificates
from data_plane.engine.step_cost import DEFAULT_ITL_GROWTH, KNEE_EFFICIENCY
from data_plane.engine.threads import available_cpus
from data_plane.lora.fetcher import FetchSettings
from data_plane.lora.hub_source import HubSettings
from data_plane.lora.s3_source import ADDRESSING_STYLES, S3Settings
from data_plane.lora.source_policy import SourcePolicy, check_entry
from data_plane.model.precision import AUTO, DTYPE_CHOICES, check_dtype

# A CPU pod's KV cache when --kv-cache-bytes is 0: ~17k tokens of the demo model in float32 (46 KB a token).
DEFAULT_CPU_KV_CACHE_BYTES = 768 << 20


@dataclass(frozen=True)
class DataPlaneConfig:
    model: Path | None  # None = the demo model
    host: str = defaults.HOST
    port: int = defaults.POD_PORT
    metrics_port: int = defaults.POD_METRICS_PORT
    health_port: int = 0  # a plaintext port with only grpc.health.v1, for probes that cannot do TLS; 0 = none
    device: str = defaults.DEVICE
    # The precision (data_plane/model/precision.py), or "auto": bfloat16 on CUDA; on CPU float32 weights with
    # float32 or bfloat16 projections, whichever measures faster on this CPU at start-up.
    dtype: str = AUTO
    # torch threads the model thread computes on (every other thread of the pod computes on one); 0 = every
    # CPU the process may run on (engine/threads.py).
    compute_threads: int = 0
    max_loras: int = defaults.MAX_LORAS
    max_cpu_loras: int = defaults.MAX_CPU_LORAS
    max_lora_rank: int = defaults.MAX_LORA_RANK
    control_plane: str | None = None
    control_plane_ca: Path | None = None  # PEM CA of the control plane's TLS certificate; None = tls_ca_file's
    # This pod's certificate and key: its gRPC server serves TLS with them, and shows them to the control plane.
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    # CA of the fleet's certificates: callers of the pod must show one it signed; the control plane is dialed over
    # TLS and verified against it (unless control_plane_ca). None: no client certificates asked.
    tls_ca_file: Path | None = None
    pod_id: str = ""
    endpoint: str = ""  # what the pod tells the control plane to dial; default host:port
    adapter_roots: tuple[Path, ...] = ()
    # The control plane's token (its --pod-token-file): the only one DataPlaneAdmin's commands accept, and the
    # one this pod sends to the control plane. None: DataPlaneAdmin is open (a pod on its own).
    admin_token_file: Path | None = None
    reader_token_file: Path | None = None  # readers' token (routers): GetState only
    allow_pickle_adapters: bool = False
    max_adapter_bytes: int = 2 << 30
    adapter_cache_dir: Path | None = None  # None = $LORAFLEET_HOME/adapter-cache (see pod.build_engine)
    adapter_download_timeout_s: float = 30.0
    adapter_disk_cache_bytes: int = 10 << 30  # the disk tier's bound on downloaded adapters
    adapter_source_allow: tuple[str, ...] = ()  # --adapter-source-allow entries; () = every scheme
    s3_endpoint_url: str = ""  # "" = boto3's: AWS_ENDPOINT_URL, else AWS
    s3_region: str = ""  # "" = boto3's: AWS_DEFAULT_REGION, ...
    s3_addressing_style: str = "auto"
    hf_endpoint: str = ""  # "" = huggingface_hub's: HF_ENDPOINT, else huggingface.co
    hf_token_file: Path | None = None  # None = huggingface_hub's: HF_TOKEN, else its token file
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    max_waiting: int = 256
    # Longest estimated wait for a first token a new request is admitted with (0 = no limit); see
    # engine/admission.py. A caller's shorter gRPC deadline tightens it per request. What a pod promises
    # an admitted request: past it, a client is better served by another pod or a retry after the hint,
    # and under overload the queue stays this short (benchmarks/overload.py). Under sustained overload
    # admitted first tokens come up to it, so it is also how much slower than an unloaded pod's they may
    # be: 1.5 s keeps a CPU pod's p99 at twice its capacity within 3x its p99 at half, where 2 s did not
    # (docs/scheduling.md; benchmarks/RESULTS.md, "Overload at the defaults: a 1.5 s promise").
    max_queue_delay_s: float = 1.5
    # The step time prefill work may fill a step up to, beside its decodes; 0 = relative, by itl_growth.
    target_itl_s: float = 0.0
    # A step that also prefills lasts at most this many times its decodes alone (a graph pod: the eager step
    # that prefills beside them); 0 = up to the device's
    # throughput knee instead (engine/step_cost.py).
    itl_growth: float = DEFAULT_ITL_GROWTH
    scheduling_policy: str = "fair"  # "fair" (fair shares across adapters) or "fcfs" (arrival order)
    adapter_weights: tuple[tuple[str, float], ...] = ()  # (adapter, fair-share weight); others weigh 1
    base_model_weight: float = 1.0  # the base model's fair-share weight
    block_size: int = 16
    num_kv_blocks: int = 0  # 0 = sized from kv_cache_bytes
    # Bytes of KV cache; 0 = on CUDA what --gpu-memory-utilization leaves after a profile run of the largest
    # step, on CPU DEFAULT_CPU_KV_CACHE_BYTES.
    kv_cache_bytes: int = 0
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # no CUDA graphs: every step runs eagerly
    prefix_caching: bool = True  # full KV blocks kept and reused by prompts that begin alike
    # Routing-prefix hashes GetState reports for routers (8 bytes each); 0 = none (prefix_report.py).
    prefix_report_size: int = 512
    drain_grace_s: float = 30.0
    heartbeat_interval_s: float = 1.0
    # Seconds the engine loop may go without progress while requests wait before health turns NOT_SERVING.
    stall_timeout_s: float = 30.0
    # Per-adapter request rates in heartbeats: decayed over this window, the busiest this many listed.
    demand_window_s: float = 30.0
    demand_report_top: int = 32

    def __post_init__(self) -> None:
        if not 0 <= self.health_port <= 65535:
            raise ValueError(f"--health-port {self.health_port} is not a TCP port; use 1-65535, or 0 for none")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, not {self.device!r}")
        check_dtype(self.dtype, self.device)
        if self.compute_threads < 0:
            raise ValueError(f"--compute-threads must be >= 0 (0 = every CPU this process may run on), "
                             f"got {self.compute_threads}")
        if not 1 <= self.max_loras <= self.max_cpu_loras:
            raise ValueError(f"need 1 <= --max-loras ({self.max_loras}) <= --max-cpu-loras ({self.max_cpu_loras})")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"--max-lora-rank must be within 1..512, got {self.max_lora_rank}")
        if self.control_plane and not self.admin_token_file:
            raise ValueError("--control-plane needs --admin-token-file (the control plane's bearer token)")
        if self.reader_token_file is not None and self.admin_token_file is None:
            raise ValueError("--reader-token-file needs --admin-token-file: without it DataPlaneAdmin is open to all")
        if self.control_plane_ca is not None:
            if not self.control_plane:
                raise ValueError("--control-plane-ca needs --control-plane (the control plane to dial over TLS)")
        if self.tls_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("--tls-ca needs --tls-cert and --tls-key: a pod that asks its callers for certificates "
                             "serves TLS itself, and shows its certificate to the control plane")
        self.control_plane_dialer()  # refuses a missing, unreadable or mismatched file now, not at dial time
        if min(self.max_num_seqs, self.max_num_batched_tokens, self.block_size) < 1 or self.num_kv_blocks < 0:
            raise ValueError("engine limits must be positive")
        if self.kv_cache_bytes < 0:
            raise ValueError(f"--kv-cache-bytes must be >= 0 (0 = automatic), got {self.kv_cache_bytes}")
        if self.max_adapter_bytes < 1 or self.adapter_download_timeout_s <= 0:
            raise ValueError("--max-adapter-bytes and --adapter-download-timeout must be positive")
        if self.adapter_disk_cache_bytes < 0:
            raise ValueError(f"--adapter-disk-cache-bytes must be >= 0, got {self.adapter_disk_cache_bytes}")
        for entry in self.adapter_source_allow:
            check_entry(entry)
        S3Settings(self.s3_endpoint_url, self.s3_region, self.s3_addressing_style)  # validates the S3 flags
        if not 0.1 <= self.gpu_memory_utilization <= 0.99:
            raise ValueError("--gpu-memory-utilization must be within 0.1..0.99")
        if not self.stall_timeout_s > 0:  # NaN too: it would never declare a stall
            raise ValueError(f"--stall-timeout must be positive, got {self.stall_timeout_s}")
        if not 0 <= self.max_queue_delay_s < math.inf:
            raise ValueError(f"--max-queue-delay must be a number of seconds >= 0 (0 = no limit), "
                             f"got {self.max_queue_delay_s}")
        if not 0 <= self.target_itl_s < math.inf:
            raise ValueError(f"--target-itl must be a number of seconds >= 0 (0 = relative, by --itl-growth), "
                             f"got {self.target_itl_s}")
        if not (self.itl_growth == 0 or 1 < self.itl_growth < math.inf):
            raise ValueError(f"--itl-growth must be a factor above 1 (e.g. {DEFAULT_ITL_GROWTH}), or 0 for the "
                             f"device's throughput knee, got {self.itl_growth}")
        if not 0 < self.demand_window_s < math.inf:
            raise ValueError(f"--demand-window must be a positive number of seconds, got {self.demand_window_s}")
        if not 1 <= self.demand_report_top <= 1000:
            raise ValueError(f"--demand-report-top must be within 1..1000, got {self.demand_report_top}")
        if not 0 <= self.prefix_report_size <= 65536:
            raise ValueError(f"--prefix-report-size must be within 0..65536 (0 = report none), "
                             f"got {self.prefix_report_size}")
        if self.scheduling_policy not in ("fair", "fcfs"):
            raise ValueError(f"--scheduling-policy must be fair or fcfs, not {self.scheduling_policy!r}")
        for name, weight in (*self.adapter_weights, ("the base model", self.base_model_weight)):
            if not 0 < weight < math.inf:
                raise ValueError(f"the fair-share weight of {name} must be a positive number, got {weight}")

    @property
    def fair_share_weights(self) -> dict[str | None, float]:
        """Each tenant's fair-share weight as the scheduler takes them (None: the base model)."""
        return {None: self.base_model_weight, **dict(self.adapter_weights)}

    def tls_files(self) -> TlsFiles:
        """--tls-cert, --tls-key and --tls-ca, each read and checked."""
        return TlsFiles(self.tls_cert_file, self.tls_key_file, self.tls_ca_file)

    def control_plane_dialer(self) -> Dialer:
        """How the pod dials the control plane: over TLS verified against --control-plane-ca, else --tls-ca,
        showing --tls-cert; in plaintext without either CA. Raises ConfigError, saying what to give instead,
        for a file that cannot be read or used."""
        root = None
        if self.control_plane_ca is not None:
            root = read_certificates(self.control_plane_ca, "--control-plane-ca",
                                     "give the PEM file of the CA that signed the control plane's --tls-cert, or "
                                     "that certificate itself when it is self-signed")
        return self.tls_files().dialer(root)

    def fetch_settings(self, default_cache_dir: Path) -> FetchSettings:
        """How the pod downloads remote adapters, into --adapter-cache-dir or ``default_cache_dir``."""
        return FetchSettings(
            cache_dir=self.adapter_cache_dir or default_cache_dir, disk_cache_bytes=self.adapter_disk_cache_bytes,
            timeout_s=self.adapter_download_timeout_s, max_bytes=self.max_adapter_bytes,
            policy=SourcePolicy(self.adapter_source_allow),
            s3=S3Settings(self.s3_endpoint_url, self.s3_region, self.s3_addressing_style),
            hub=HubSettings(self.hf_endpoint, self.hf_token_file),
        )

    @property
    def resolved_pod_id(self) -> str:
        return self.pod_id or f"{socket.gethostname()}-{self.port}"

    @property
    def resolved_compute_threads(self) -> int:
        return self.compute_threads or available_cpus()

    @property
    def resolved_endpoint(self) -> str:
        return self.endpoint or f"{self.host}:{self.port}"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DataPlaneConfig:
        return cls(
            model=Path(args.model) if args.model else None, host=args.host, port=args.port,
            metrics_port=args.metrics_port, health_port=args.health_port,
            device=args.device, dtype=args.dtype, compute_threads=args.compute_threads, max_loras=args.max_loras,
            max_cpu_loras=args.max_cpu_loras, max_lora_rank=args.max_lora_rank, control_plane=args.control_plane,
            control_plane_ca=Path(args.control_plane_ca) if args.control_plane_ca else None,
            tls_cert_file=Path(args.tls_cert) if args.tls_cert else None,
            tls_key_file=Path(args.tls_key) if args.tls_key else None,
            tls_ca_file=Path(args.tls_ca) if args.tls_ca else None,
            pod_id=args.pod_id or "", endpoint=args.endpoint or "",
            adapter_roots=tuple(Path(p) for p in args.adapter_root or ()),
            admin_token_file=Path(args.admin_token_file) if args.admin_token_file else None,
            reader_token_file=Path(args.reader_token_file) if args.reader_token_file else None,
            allow_pickle_adapters=args.allow_pickle_adapters, max_adapter_bytes=args.max_adapter_bytes,
            adapter_cache_dir=Path(args.adapter_cache_dir) if args.adapter_cache_dir else None,
            adapter_download_timeout_s=args.adapter_download_timeout,
            adapter_disk_cache_bytes=args.adapter_disk_cache_bytes,
            adapter_source_allow=tuple(args.adapter_source_allow or ()), s3_endpoint_url=args.s3_endpoint_url,
            s3_region=args.s3_region, s3_addressing_style=args.s3_addressing_style, hf_endpoint=args.hf_endpoint,
            hf_token_file=Path(args.hf_token_file) if args.hf_token_file else None,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_waiting=args.max_waiting, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
            kv_cache_bytes=args.kv_cache_bytes, enforce_eager=args.enforce_eager,
            prefix_caching=not args.no_prefix_caching, prefix_report_size=args.prefix_report_size,
            gpu_memory_utilization=args.gpu_memory_utilization, drain_grace_s=args.drain_grace,
            heartbeat_interval_s=args.heartbeat_interval, stall_timeout_s=args.stall_timeout,
            max_queue_delay_s=args.max_queue_delay, target_itl_s=args.target_itl, itl_growth=args.itl_growth,
            scheduling_policy=args.scheduling_policy,
            adapter_weights=tuple(args.adapter_weight or ()), base_model_weight=args.base_model_weight,
            demand_window_s=args.demand_window, demand_report_top=args.demand_report_top,
        )


class RemovedFlag(argparse.Action):
    """``--cpu-matmul``, folded into ``--dtype``: refused with the --dtype that says the same."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} was folded into --dtype, which now names the whole precision: "
                     "--dtype float32 for float32 everywhere (was --cpu-matmul float32), --dtype bfloat16-matmul "
                     "for bfloat16 projections on a float32 CPU model (was --cpu-matmul bfloat16), or --dtype auto "
                     "to measure which is faster (was --cpu-matmul auto)")


def adapter_weight(text: str) -> tuple[str, float]:
    """Parses one --adapter-weight NAME=WEIGHT."""
    name, sep, weight = text.rpartition("=")
    if not sep or not is_valid_name(name):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=WEIGHT with NAME {NAME_RULE}, e.g. pirate=2")
    try:
        value = float(weight)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the weight {weight!r} is not a number") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r}: the weight must be a positive number")
    return name, value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``lorafleet data-plane`` flags."""
    d = DataPlaneConfig(model=None)
    p.add_argument("--model", help="Hugging Face model directory (default: the demo model)")
    p.add_argument("--host", default=d.host, help="address to listen on")
    p.add_argument("--port", type=int, default=d.port, help="gRPC port (Generation, DataPlaneAdmin, health)")
    p.add_argument("--metrics-port", type=int, default=d.metrics_port, help="Prometheus /metrics port (0 = off)")
    p.add_argument("--health-port", type=int, default=d.health_port,
                   help="a plaintext gRPC port serving only the health service, for probes that cannot speak TLS "
                        "(Kubernetes' gRPC probes) beside --tls-cert (0 = none)")
    p.add_argument("--device", default=d.device, choices=["cpu", "cuda"], help="compute device")
    p.add_argument("--dtype", default=d.dtype, choices=DTYPE_CHOICES,
                   help="the precision the pod computes in, the same for every request and step: float32; bfloat16; "
                        "float16 (cuda); bfloat16-matmul (cpu: float32 but for the projection matmuls, whose operands "
                        "and outputs are rounded to bfloat16); auto (default): bfloat16 on cuda, and on cpu "
                        "bfloat16-matmul where it measures faster at start-up, else float32")
    p.add_argument("--cpu-matmul", action=RemovedFlag, help=argparse.SUPPRESS)
    p.add_argument("--compute-threads", type=int, default=d.compute_threads, metavar="N",
                   help="torch threads the model thread computes every step on; the pod's other threads compute on "
                        f"one, so that their thread teams never outnumber the cores (0 = every CPU this process may "
                        f"run on, {available_cpus()} here; in a container limited by CPU quota rather than a cpuset, "
                        "set it to the limit; pods that share a machine's cores need a share each: a team's threads "
                        "spin between ops, and pods spinning against each other on the same cores run many times "
                        "slower)")
    p.add_argument("--max-loras", type=int, default=d.max_loras, help="adapter slots on the compute device")
    p.add_argument("--max-cpu-loras", type=int, default=d.max_cpu_loras, help="adapters held in host memory")
    p.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank, help="largest adapter rank accepted")
    p.add_argument("--control-plane", help="control plane host:port to register with and heartbeat to")
    p.add_argument("--control-plane-ca", metavar="FILE",
                   help="PEM certificate of the CA that signed the control plane's --tls-cert (or that certificate "
                        "itself when self-signed): dial the control plane over TLS (default: --tls-ca when given, "
                        "else plaintext)")
    p.add_argument("--tls-cert", metavar="FILE",
                   help="this pod's PEM certificate chain (with --tls-key): serve gRPC over TLS with it, and show it "
                        "to the control plane when dialing it over TLS; re-read when it changes (default: plaintext)")
    p.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert (default: none)")
    p.add_argument("--tls-ca", metavar="FILE",
                   help="PEM CA of the fleet's component certificates, for mutual TLS: every caller (the control "
                        "plane, routers) must show a certificate it signed, and the control plane is dialed over TLS "
                        "and verified against it; needs --tls-cert (default: callers show no certificate)")
    p.add_argument("--pod-id", help="this pod's identifier (default: hostname-port)")
    p.add_argument("--endpoint", help="host:port the control plane and clients dial (default: host:port)")
    p.add_argument("--adapter-root", action="append",
                   help="directory adapters may be loaded from (repeatable; none by default); "
                        "its subdirectories load by name")
    p.add_argument("--admin-token-file",
                   help="file holding the control plane's token: the only one DataPlaneAdmin's commands accept, and"
                        " the one sent to the control plane (default: DataPlaneAdmin open)")
    p.add_argument("--reader-token-file",
                   help="file holding the readers' token (routers): DataPlaneAdmin GetState only (default: none)")
    p.add_argument("--allow-pickle-adapters", action="store_true",
                   help="accept adapter_model.bin (loaded with torch.load(weights_only=True))")
    p.add_argument("--max-adapter-bytes", type=int, default=d.max_adapter_bytes, help="largest adapter file")
    p.add_argument("--adapter-cache-dir",
                   help="the disk tier: where remote adapters (http, s3, hf) are downloaded and kept by sha256; one "
                        "directory per pod, kept across restarts (default: $LORAFLEET_HOME/adapter-cache/POD_ID)")
    p.add_argument("--adapter-disk-cache-bytes", type=int, default=d.adapter_disk_cache_bytes,
                   help="most bytes of downloaded adapters the disk tier keeps; least recently used go first "
                        f"(default {d.adapter_disk_cache_bytes})")
    p.add_argument("--adapter-download-timeout", type=float, default=d.adapter_download_timeout_s,
                   help="seconds an adapter download may wait on the server before it fails")
    p.add_argument("--adapter-source-allow", action="append", metavar="ENTRY",
                   help="an adapter source this pod may fetch (repeatable): a scheme (file, http, https, s3, hf), "
                        "http[s]://HOST[:PORT], s3://BUCKET or hf://ORG[/REPO]; default: every scheme. http(s) "
                        "sources at loopback or link-local addresses are refused unless an entry names the host")
    p.add_argument("--s3-endpoint-url", default=d.s3_endpoint_url,
                   help="S3-compatible endpoint for s3:// sources (default: AWS_ENDPOINT_URL, else AWS)")
    p.add_argument("--s3-region", default=d.s3_region, help="S3 region (default: AWS_DEFAULT_REGION)")
    p.add_argument("--s3-addressing-style", default=d.s3_addressing_style, choices=ADDRESSING_STYLES,
                   help="bucket in the path or the host name; auto (default): path-style for any endpoint but AWS's")
    p.add_argument("--hf-endpoint", default=d.hf_endpoint,
                   help="Hugging Face Hub endpoint for hf:// sources (default: HF_ENDPOINT, else huggingface.co)")
    p.add_argument("--hf-token-file",
                   help="file holding the Hub token for hf:// sources, read at each download "
                        "(default: HF_TOKEN, else the Hub's token file)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="most tokens in one step (bounds prefill chunks)")
    p.add_argument("--max-waiting", type=int, default=d.max_waiting,
                   help="queued requests before RESOURCE_EXHAUSTED")
    p.add_argument("--max-queue-delay", type=float, default=d.max_queue_delay_s,
                   help="refuse a new request (RESOURCE_EXHAUSTED with a grpc-retry-pushback-ms hint) when it would "
                        "wait longer than this many seconds behind other work before its own prefill, by the pod's "
                        "estimate; a request is also refused when its estimated first token would come after its "
                        "gRPC deadline (0 = no limit)")
    p.add_argument("--target-itl", type=float, default=d.target_itl_s, metavar="SECONDS",
                   help="step time that prefill work may fill a step up to beside its running decodes, which always "
                        f"get their token (default {d.target_itl_s}: relative, see --itl-growth; with nothing "
                        "decoding a step prefills up to --max-num-batched-tokens)")
    p.add_argument("--itl-growth", type=float, default=d.itl_growth, metavar="FACTOR",
                   help="a step that prefills new prompts beside running streams lasts at most FACTOR times their "
                        "decodes alone (on a pod replaying CUDA graphs for decode steps, FACTOR times the eager step "
                        "that prefills beside them), by the step-time model the pod fits to its own steps (default "
                        f"{d.itl_growth}: streams' inter-token gaps grow by about that while prompts arrive, except in "
                        "steps that make up for an admitted request that would otherwise get its first token after its "
                        "promise); 0 = "
                        "throughput instead: such a step may last at least as long as the step whose prefill runs at "
                        f"{KNEE_EFFICIENCY * 100:.0f}%% of the device's peak prefill rate (more prompts per second, "
                        "several times longer gaps while they are prefilled)")
    p.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=["fair", "fcfs"],
                   help="admission order of waiting requests: fair shares across adapters (the least-served "
                        "adapter's oldest request next) or first come, first served")
    p.add_argument("--adapter-weight", action="append", type=adapter_weight, metavar="NAME=WEIGHT",
                   help="an adapter's fair-share weight relative to the others' 1.0 (repeatable)")
    p.add_argument("--base-model-weight", type=float, default=d.base_model_weight,
                   help="the base model's fair-share weight relative to the adapters' 1.0")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV-cache block")
    p.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks,
                   help=f"KV-cache blocks (default {d.num_kv_blocks}: sized from --kv-cache-bytes)")
    p.add_argument("--kv-cache-bytes", type=int, default=d.kv_cache_bytes,
                   help=f"bytes of KV cache (default {d.kv_cache_bytes}: on CUDA what --gpu-memory-utilization "
                        "leaves after a profile run of the largest step with an adapter in every slot; on CPU "
                        f"{DEFAULT_CPU_KV_CACHE_BYTES >> 20} MiB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="fraction of GPU memory the pod may use (model, adapters, activations, KV cache) "
                        f"(default {d.gpu_memory_utilization})")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="compute every prompt in full (default: full KV blocks are kept and reused by later prompts "
                        "that begin with the same tokens under the same adapter content and precision)")
    p.add_argument("--prefix-report-size", type=int, default=d.prefix_report_size,
                   help="routing-prefix hashes of the prompts whose KV blocks the prefix cache holds that GetState "
                        "reports, so that routers send a request where its prompt's beginning is cached; 0 reports "
                        f"none (default {d.prefix_report_size})")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly on CUDA (default: decode steps replay CUDA graphs captured at "
                        "start-up per batch-size bucket)")
    p.add_argument("--drain-grace", type=float, default=d.drain_grace_s,
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--heartbeat-interval", type=float, default=d.heartbeat_interval_s,
                   help="seconds between heartbeats to the control plane; at most a third of the lease it "
                        f"grants, and well under its --pod-probe-after (default {d.heartbeat_interval_s})")
    p.add_argument("--stall-timeout", type=float, default=d.stall_timeout_s,
                   help="seconds the engine loop may make no progress while requests wait before the pod's "
                        "health (readiness and lorafleet.liveness) turns NOT_SERVING")
    p.add_argument("--demand-window", type=float, default=d.demand_window_s,
                   help="seconds over which the per-adapter request rates sent in heartbeats decay (the control "
                        f"plane replicates hot adapters from them) (default {d.demand_window_s})")
    p.add_argument("--demand-report-top", type=int, default=d.demand_report_top,
                   help="how many of the busiest adapters each heartbeat lists by rate; the rest are summed "
                        f"(default {d.demand_report_top})")


def build_parser() -> argparse.ArgumentParser:
    """The ``lorafleet data-plane`` command line."""
    p = argparse.ArgumentParser(prog="lorafleet data-plane", description="Run a data-plane pod.",
                                formatter_class=DefaultsShown)
    add_arguments(p)
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p
