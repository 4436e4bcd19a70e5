"""The data-plane pod's configuration: built once from flags, frozen, validated."""

from __future__ import annotations

import argparse
import math
import socket
from dataclasses import dataclass
from pathlib import Path

from conventions import defaults
from conventions.flag_help import DefaultsShown
from conventions.flags import add_options, from_args, option
from conventions.logs import add_log_level
from conventions.names import NAME_RULE, is_valid_name
from conventions.tls import Dialer, TlsFiles, read_certificates
from data_plane.engine.step_cost import DEFAULT_ITL_GROWTH, KNEE_EFFICIENCY
from data_plane.engine.threads import available_cpus
from data_plane.lora.fetcher import FetchSettings
from data_plane.lora.hub_source import HubSettings
from data_plane.lora.s3_source import ADDRESSING_STYLES, S3Settings
from data_plane.lora.source_policy import SourcePolicy, check_entry
from data_plane.model.attention import KV_CACHE_DTYPES
from data_plane.model.precision import AUTO, DTYPE_CHOICES, check_dtype
from data_plane.model.quantization import QUANTIZATION_CHOICES

# A CPU pod's KV cache when --kv-cache-bytes is 0: ~17k tokens of the demo model in float32 (46 KB a token).
DEFAULT_CPU_KV_CACHE_BYTES = 768 << 20
TLS, FLEET, ADAPTERS, STEPS, MEMORY = ("TLS between components", "the fleet", "adapters", "steps and scheduling",
                                       "memory and CUDA graphs")


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


@dataclass(frozen=True)
class DataPlaneConfig:
    """Everything one pod needs; validated on construction. Each field with ``option`` is the flag of its name
    (conventions/flags.py)."""

    # None = the demo model
    model: Path | None = option("Hugging Face model directory (default: the demo model)", None)
    host: str = option("address to listen on", defaults.HOST)
    port: int = option("gRPC port (Generation, DataPlaneAdmin, health)", defaults.POD_PORT)
    metrics_port: int = option("Prometheus /metrics port (0 = off)", defaults.POD_METRICS_PORT)
    health_port: int = option(
        "a plaintext gRPC port serving only the health service, for probes that cannot speak TLS (Kubernetes' gRPC"
        " probes) beside --tls-cert (0 = none)", 0)
    device: str = option("compute device", defaults.DEVICE, choices=("cpu", "cuda"))
    # The precision (data_plane/model/precision.py), or "auto": bfloat16 on CUDA; on CPU float32 weights with
    # float32 or bfloat16 projections, whichever measures faster on this CPU at start-up.
    dtype: str = option(
        "the precision the pod computes in, the same for every request and step: float32; bfloat16; float16 (cuda);"
        " bfloat16-matmul (cpu: float32 but for the projection matmuls, whose operands and outputs are rounded to"
        " bfloat16); auto (default): bfloat16 on cuda, and on cpu bfloat16-matmul where it measures faster at"
        " start-up, else float32", AUTO, choices=DTYPE_CHOICES)
    # FP8 base weights (data_plane/model/quantization.py): the pod's precision then reads e.g. bfloat16+fp8.
    quantization: str = option(
        "the base model's weights: auto runs a checkpoint as published, an FP8 one (compressed-tensors"
        " float-quantized, or quant_method fp8/fbgemm_fp8, with per-tensor or per-channel weight_scale) in FP8; fp8"
        " also quantizes an unquantized checkpoint's projection weights to FP8 per output channel at load. FP8"
        " weights run W8A8 (per-token activation scales) on GPUs of compute capability 8.9+, weight-only on other"
        " GPUs, and dequantized once to --dtype on cpu; adapters apply in --dtype as on the unquantized base", AUTO,
        choices=QUANTIZATION_CHOICES)
    # CPU attention (data_plane/model/attention_backends.py): the native kernel reads the paged cache in place.
    cpu_attention: str = option(
        "how a cpu pod computes attention: native (default) reads the paged KV cache in place with a C++ kernel"
        " compiled for this CPU at start-up (by $CXX or c++, cached under $LORAFLEET_NATIVE_CACHE or"
        " ~/.cache/lorafleet/native), falling back to tiled, with a warning, where it cannot build; tiled gathers"
        " each step's contexts and multiplies them in fixed tiles. Both keep a request's tokens independent of what"
        " shares its step", "native", choices=("native", "tiled"))
    # torch threads the model thread computes on (every other thread of the pod computes on one); 0 = every
    # CPU the process may run on (engine/threads.py).
    compute_threads: int = option(
        "torch threads the model thread computes every step on; the pod's other threads compute on one, so that"
        " their thread teams never outnumber the cores (0 = every CPU this process may run on; in a container"
        " limited by CPU quota rather than a cpuset, set it to the limit; pods that share a machine's cores need a"
        " share each: a team's threads spin between ops, and pods spinning against each other on the same cores"
        " run many times slower)", 0, metavar="N")
    # False: the model keeps its plain projections and no adapter slot exists; adapter requests are refused.
    enable_lora: bool = option(
        "serve adapters (default: on); --no-enable-lora starts a pod of the base model only: no LoRA layers, no"
        " adapter slots, no LoRA work in any step, and every request or load naming an adapter is refused with"
        " FAILED_PRECONDITION (--max-loras, --max-cpu-loras and --max-lora-rank are then unused)", True,
        group=ADAPTERS)
    max_loras: int = option("adapter slots on the compute device", defaults.MAX_LORAS, group=ADAPTERS)
    max_cpu_loras: int = option("adapters held in host memory", defaults.MAX_CPU_LORAS, group=ADAPTERS)
    max_lora_rank: int = option("largest adapter rank accepted", defaults.MAX_LORA_RANK, group=ADAPTERS)
    control_plane: str | None = option("control plane host:port to register with and heartbeat to (default: none,"
                                       " a pod on its own)", None, group=FLEET)
    # PEM CA of the control plane's TLS certificate; None = tls_ca's
    control_plane_ca: Path | None = option(
        "PEM certificate of the CA that signed the control plane's --tls-cert (or that certificate itself when"
        " self-signed): dial the control plane over TLS (default: --tls-ca when given, else plaintext)", None,
        metavar="FILE", group=TLS)
    # This pod's certificate and key: its gRPC server serves TLS with them, and shows them to the control plane.
    tls_cert: Path | None = option(
        "this pod's PEM certificate chain (with --tls-key): serve gRPC over TLS with it, and show it to the control"
        " plane when dialing it over TLS; re-read when it changes (default: plaintext)", None, metavar="FILE",
        group=TLS)
    tls_key: Path | None = option("PEM private key of --tls-cert (default: none)", None, metavar="FILE", group=TLS)
    # CA of the fleet's certificates: callers of the pod must show one it signed; the control plane is dialed over
    # TLS and verified against it (unless control_plane_ca). None: no client certificates asked.
    tls_ca: Path | None = option(
        "PEM CA of the fleet's component certificates, for mutual TLS: every caller (the control plane, routers)"
        " must show a certificate it signed, and the control plane is dialed over TLS and verified against it;"
        " needs --tls-cert (default: callers show no certificate)", None, metavar="FILE", group=TLS)
    pod_id: str = option("this pod's identifier (default: hostname-port)", "", group=FLEET)
    # what the pod tells the control plane to dial; default host:port
    endpoint: str = option("host:port the control plane and clients dial (default: host:port)", "", group=FLEET)
    adapter_roots: tuple[Path, ...] = option(
        "directory adapters may be loaded from (repeatable; none by default); its subdirectories load by name", (),
        group=ADAPTERS)
    # The control plane's token (its --pod-token-file): the only one DataPlaneAdmin's commands accept, and the
    # one this pod sends to the control plane. None: DataPlaneAdmin is open (a pod on its own).
    admin_token_file: Path | None = option(
        "file holding the control plane's token: the only one DataPlaneAdmin's commands accept, and the one sent to"
        " the control plane (default: DataPlaneAdmin open)", None, group=FLEET)
    reader_token_file: Path | None = option(
        "file holding the readers' token (routers): DataPlaneAdmin GetState only (default: none)", None, group=FLEET)
    allow_pickle_adapters: bool = option("accept adapter_model.bin (loaded with torch.load(weights_only=True))",
                                         False, group=ADAPTERS)
    max_adapter_bytes: int = option("largest adapter file", 2 << 30, group=ADAPTERS)
    # None = $LORAFLEET_HOME/adapter-cache (see pod.build_engine)
    adapter_cache_dir: Path | None = option(
        "the disk tier: where remote adapters (http, s3, hf) are downloaded and kept by sha256; one directory per"
        " pod, kept across restarts (default: $LORAFLEET_HOME/adapter-cache/POD_ID)", None, group=ADAPTERS)
    adapter_download_timeout: float = option(
        "seconds an adapter download may wait on the server before it fails", 30.0, group=ADAPTERS)
    adapter_disk_cache_bytes: int = option(
        "most bytes of downloaded adapters the disk tier keeps; least recently used go first", 10 << 30,
        group=ADAPTERS)
    adapter_source_allow: tuple[str, ...] = option(
        "an adapter source this pod may fetch (repeatable): a scheme (file, http, https, s3, hf),"
        " http[s]://HOST[:PORT], s3://BUCKET or hf://ORG[/REPO]; default: every scheme. http(s) sources at loopback"
        " or link-local addresses are refused unless an entry names the host", (), metavar="ENTRY", group=ADAPTERS)
    s3_endpoint_url: str = option(
        "S3-compatible endpoint for s3:// sources (default: AWS_ENDPOINT_URL, else AWS)", "", group=ADAPTERS)
    s3_region: str = option("S3 region (default: AWS_DEFAULT_REGION)", "", group=ADAPTERS)
    s3_addressing_style: str = option(
        "bucket in the path or the host name; auto (default): path-style for any endpoint but AWS's", "auto",
        choices=ADDRESSING_STYLES, group=ADAPTERS)
    hf_endpoint: str = option(
        "Hugging Face Hub endpoint for hf:// sources (default: HF_ENDPOINT, else huggingface.co)", "",
        group=ADAPTERS)
    hf_token_file: Path | None = option(
        "file holding the Hub token for hf:// sources, read at each download (default: HF_TOKEN, else the Hub's"
        " token file)", None, group=ADAPTERS)
    max_num_seqs: int = option("most sequences in one step", 32, group=STEPS)
    max_num_batched_tokens: int = option("most tokens in one step (bounds prefill chunks)", 1024, group=STEPS)
    max_waiting: int = option("queued requests before RESOURCE_EXHAUSTED", 256, group=STEPS)
    # Longest estimated wait for a first token a new request is admitted with (0 = no limit); see
    # engine/admission.py. A caller's shorter gRPC deadline tightens it per request. What a pod promises
    # an admitted request: past it, a client is better served by another pod or a retry after the hint,
    # and under overload the queue stays this short (benchmarks/overload.py). Under sustained overload
    # admitted first tokens come up to it, so it is also how much slower than an unloaded pod's they may
    # be: 1.5 s keeps a CPU pod's p99 at twice its capacity within 3x its p99 at half, where 2 s did not
    # (docs/scheduling.md; benchmarks/RESULTS.md, "Overload at the defaults: a 1.5 s promise").
    max_queue_delay: float = option(
        "refuse a new request (RESOURCE_EXHAUSTED with a grpc-retry-pushback-ms hint) when it would wait longer than"
        " this many seconds behind other work before its own prefill, by the pod's estimate; a request is also"
        " refused when its estimated first token would come after its gRPC deadline (0 = no limit)", 1.5,
        group=STEPS)
    # The step time prefill work may fill a step up to, beside its decodes; 0 = relative, by itl_growth.
    target_itl: float = option(
        "step time that prefill work may fill a step up to beside its running decodes, which always get their token"
        " (default 0.0: relative, see --itl-growth; with nothing decoding a step prefills up to"
        " --max-num-batched-tokens)", 0.0, metavar="SECONDS", group=STEPS)
    # A step that also prefills lasts at most this many times its decodes alone; 0 = up to the device's
    # throughput knee instead (engine/step_cost.py).
    itl_growth: float = option(
        "a step that prefills new prompts beside running streams lasts at most FACTOR times their decodes alone, by"
        " the step-time model the pod fits to its own steps (default"
        f" {DEFAULT_ITL_GROWTH}: streams' inter-token gaps grow by about that while prompts arrive, except in steps"
        " that make up for an admitted request that would otherwise get its first token after its promise); 0 ="
        " throughput instead: such a step may last at least as long as the step whose prefill runs at"
        f" {KNEE_EFFICIENCY * 100:.0f}%% of the device's peak prefill rate (more prompts per second, several times"
        " longer gaps while they are prefilled)", DEFAULT_ITL_GROWTH, metavar="FACTOR", group=STEPS)
    scheduling_policy: str = option(
        "admission order of waiting requests: fair shares across adapters (the least-served adapter's oldest"
        " request next) or first come, first served", "fair", choices=("fair", "fcfs"), group=STEPS)
    # The next step scheduled and launched while one runs (data_plane/engine/engine.py); False: synchronous.
    async_scheduling: bool = option(
        "schedule and launch each step while the one before it runs, its sampled tokens fed to the next step on"
        " the device and read back while that step runs (default: on); --no-async-scheduling postprocesses each"
        " step's tokens before scheduling the next. Both give the same tokens", True, group=STEPS)
    # (adapter, fair-share weight); others weigh 1
    adapter_weights: tuple[tuple[str, float], ...] = option(
        "an adapter's fair-share weight relative to the others' 1.0 (repeatable; default: none)", (),
        metavar="NAME=WEIGHT", parse=adapter_weight, show=lambda pair: f"{pair[0]}={pair[1]!r}", group=STEPS)
    base_model_weight: float = option("the base model's fair-share weight relative to the adapters' 1.0", 1.0,
                                      group=STEPS)
    block_size: int = option("tokens per KV-cache block", 16, group=MEMORY)
    num_kv_blocks: int = option("KV-cache blocks (default 0: sized from --kv-cache-bytes)", 0, group=MEMORY)
    # Bytes of KV cache; 0 = on CUDA what --gpu-memory-utilization leaves after a profile run of the largest
    # step, on CPU DEFAULT_CPU_KV_CACHE_BYTES.
    kv_cache_bytes: int = option(
        "bytes of KV cache (default 0: on CUDA what --gpu-memory-utilization leaves after a profile run of the"
        " largest step with an adapter in every slot and, unless --enforce-eager, the CUDA graphs' memory pool"
        " and decode workspace; on CPU"
        f" {DEFAULT_CPU_KV_CACHE_BYTES >> 20} MiB)", 0, group=MEMORY)
    # An FP8 KV cache (data_plane/model/kv_scales.py): half the bytes of a bf16 one per token, a scale per layer.
    kv_cache_dtype: str = option(
        "the KV cache's dtype: auto keeps the model's; fp8 stores keys and values as float8_e4m3fn, 1 byte an"
        " element, each layer's divided by its own k and v scale: the checkpoint's where it carries them"
        " (compressed-tensors kv_cache_scheme, k_scale/v_scale per layer), else calibrated at start-up (a power of"
        " two with 16x headroom over one prefill of a fixed text). Runs on cpu and on GPUs of compute capability"
        " 8.9+; the pod's precision then reads e.g. bfloat16+kv-fp8", "auto", choices=KV_CACHE_DTYPES,
        group=MEMORY)
    gpu_memory_utilization: float = option(
        "fraction of GPU memory the pod may use (model, adapters, activations, CUDA graphs, KV cache)", 0.9,
        group=MEMORY)
    enforce_eager: bool = option(
        "run every step eagerly on CUDA (default: every step is padded to a bucket and replays a CUDA graph"
        " captured at start-up: decode-only steps per batch size, steps with prompt tokens per token count, up"
        " to --max-num-batched-tokens)", False, group=MEMORY)
    # full KV blocks kept and reused by prompts that begin alike
    prefix_caching: bool = option(
        "keep full KV blocks and reuse them for later prompts that begin with the same tokens under the same adapter"
        " content and precision (default: on; --no-prefix-caching computes every prompt in full)", True,
        group=MEMORY)
    # Routing-prefix hashes GetState reports for routers (8 bytes each); 0 = none (prefix_report.py).
    prefix_report_size: int = option(
        "routing-prefix hashes of the prompts whose KV blocks the prefix cache holds that GetState reports, so that"
        " routers send a request where its prompt's beginning is cached; 0 reports none", 512, group=MEMORY)
    drain_grace: float = option("seconds in-flight requests get to finish after SIGTERM", 30.0, group=FLEET)
    heartbeat_interval: float = option(
        "seconds between heartbeats to the control plane; at most a third of the lease it grants, and well under"
        " its --pod-probe-after", 1.0, group=FLEET)
    # Seconds the engine loop may go without progress while requests wait before health turns NOT_SERVING.
    stall_timeout: float = option(
        "seconds the engine loop may make no progress while requests wait before the pod's health (readiness and"
        " lorafleet.liveness) turns NOT_SERVING", 30.0, group=FLEET)
    # Per-adapter request rates in heartbeats: decayed over this window, the busiest this many listed.
    demand_window: float = option(
        "seconds over which the per-adapter request rates sent in heartbeats decay (the control plane replicates"
        " hot adapters from them)", 30.0, group=FLEET)
    demand_report_top: int = option(
        "how many of the busiest adapters each heartbeat lists by rate; the rest are summed", 32, group=FLEET)

    def __post_init__(self) -> None:
        if not 0 <= self.health_port <= 65535:
            raise ValueError(f"--health-port {self.health_port} is not a TCP port; use 1-65535, or 0 for none")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, not {self.device!r}")
        check_dtype(self.dtype, self.device)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"not {self.kv_cache_dtype!r}")
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
        if self.tls_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-ca needs --tls-cert and --tls-key: a pod that asks its callers for certificates "
                             "serves TLS itself, and shows its certificate to the control plane")
        self.control_plane_dialer()  # refuses a missing, unreadable or mismatched file now, not at dial time
        if min(self.max_num_seqs, self.max_num_batched_tokens, self.block_size) < 1 or self.num_kv_blocks < 0:
            raise ValueError("engine limits must be positive")
        if self.kv_cache_bytes < 0:
            raise ValueError(f"--kv-cache-bytes must be >= 0 (0 = automatic), got {self.kv_cache_bytes}")
        if self.max_adapter_bytes < 1 or self.adapter_download_timeout <= 0:
            raise ValueError("--max-adapter-bytes and --adapter-download-timeout must be positive")
        if self.adapter_disk_cache_bytes < 0:
            raise ValueError(f"--adapter-disk-cache-bytes must be >= 0, got {self.adapter_disk_cache_bytes}")
        for entry in self.adapter_source_allow:
            check_entry(entry)
        S3Settings(self.s3_endpoint_url, self.s3_region, self.s3_addressing_style)  # validates the S3 flags
        if not 0.1 <= self.gpu_memory_utilization <= 0.99:
            raise ValueError("--gpu-memory-utilization must be within 0.1..0.99")
        if not self.stall_timeout > 0:  # NaN too: it would never declare a stall
            raise ValueError(f"--stall-timeout must be positive, got {self.stall_timeout}")
        if not 0 <= self.max_queue_delay < math.inf:
            raise ValueError(f"--max-queue-delay must be a number of seconds >= 0 (0 = no limit), "
                             f"got {self.max_queue_delay}")
        if not 0 <= self.target_itl < math.inf:
            raise ValueError(f"--target-itl must be a number of seconds >= 0 (0 = relative, by --itl-growth), "
                             f"got {self.target_itl}")
        if not (self.itl_growth == 0 or 1 < self.itl_growth < math.inf):
            raise ValueError(f"--itl-growth must be a factor above 1 (e.g. {DEFAULT_ITL_GROWTH}), or 0 for the "
                             f"device's throughput knee, got {self.itl_growth}")
        if not 0 < self.demand_window < math.inf:
            raise ValueError(f"--demand-window must be a positive number of seconds, got {self.demand_window}")
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
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)

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
            timeout_s=self.adapter_download_timeout, max_bytes=self.max_adapter_bytes,
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
        return from_args(cls, args)


class RemovedFlag(argparse.Action):
    """``--cpu-matmul``, folded into ``--dtype``: refused with the --dtype that says the same."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} was folded into --dtype, which now names the whole precision: "
                     "--dtype float32 for float32 everywhere (was --cpu-matmul float32), --dtype bfloat16-matmul "
                     "for bfloat16 projections on a float32 CPU model (was --cpu-matmul bfloat16), or --dtype auto "
                     "to measure which is faster (was --cpu-matmul auto)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``lorafleet data-plane`` flags."""
    add_options(p, DataPlaneConfig)
    p.add_argument("--cpu-matmul", action=RemovedFlag, help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    """The ``lorafleet data-plane`` command line."""
    p = argparse.ArgumentParser(prog="lorafleet data-plane", description="Run a data-plane pod.",
                                formatter_class=DefaultsShown)
    add_arguments(p)
    add_log_level(p)
    return p
