"""A request as the engine sees it: what was asked (``Request``, immutable), and as it runs (``Sequence``: the
request, its progress and place, and its timing)."""

from __future__ import annotations

import enum
import secrets
import time
from dataclasses import dataclass, replace
from typing import NamedTuple

from data_plane.engine.grammar import Constraint, GrammarState
from data_plane.errors import InvalidRequest

MAX_LOGIT_BIAS = 300  # token ids one request may bias (OpenAI's limit)
MAX_CHOICES = 16
# An output token sampled on the device whose id the host has not read yet (asynchronous scheduling: the
# next step is scheduled on it before its id comes back); see ``Sequence.pending``.
PENDING = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued (or preempted), holds no KV blocks
    RUNNING = "running"  # holds KV blocks and, with an adapter, a slot
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORTED = "aborted"  # cancelled, deadline passed, or failed


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 0  # 0 = up to the context limit
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None  # 64-bit; None = a random one per request
    stop: tuple[str, ...] = ()
    logprobs: int = 0
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids ascending
    n: int = 1  # choices for the prompt
    constraint: Constraint | None = None  # structured output; None = free text

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0 or self.temperature != self.temperature:
            raise InvalidRequest(f"temperature must be within [0, 100], got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0 or self.top_p != self.top_p:
            raise InvalidRequest(f"top_p must be within [0, 1] (0 or 1 disables it), got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.logprobs <= 20:
            raise InvalidRequest(f"logprobs must be within [0, 20], got {self.logprobs}")
        if len(self.stop) > 16 or any(not s or len(s) > 256 for s in self.stop):
            raise InvalidRequest("stop takes at most 16 non-empty strings of at most 256 characters")
        if self.seed is not None and not 0 <= self.seed < 1 << 64:
            raise InvalidRequest(f"seed must be within [0, 2**64), got {self.seed}")
        if self.max_tokens < 0:
            raise InvalidRequest(f"max_tokens must be >= 0, got {self.max_tokens}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias names {len(self.logit_bias)} tokens; at most {MAX_LOGIT_BIAS}")
        bad = [(t, b) for t, b in self.logit_bias if not -100.0 <= b <= 100.0]
        if bad:
            raise InvalidRequest(f"logit_bias of token {bad[0][0]} is {bad[0][1]}; biases lie within [-100, 100]")
        if not 1 <= self.n <= MAX_CHOICES:
            raise InvalidRequest(f"n must be within [1, {MAX_CHOICES}], got {self.n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class TokenOut(NamedTuple):
    """A sampled token. (A tuple: a step makes one per sequence, several times faster than a frozen dataclass.)"""

    id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # most likely alternatives, most likely first


@dataclass
class Timing:
    """A request's timeline and what admission promised it (``time.monotonic()`` seconds): written as each
    event happens (admission by the engine, the first step by the scheduler, tokens by the step's
    postprocess), read for latency metrics, the admission estimate's calibration and the scheduler's
    first-token promises; nothing in it changes what the request computes."""

    ttft_estimate: float | None = None  # the wait for a first token admission estimated for it (seconds)
    ttft_bias: float = 1.0  # the correction (DelayEstimator.calibration) that estimate was made with
    first_token_due: float | None = None  # when its first token was promised by (None: no promise)
    waited_for_adapter: bool = False  # its adapter was not resident at arrival: its first token waits for the load
    first_scheduled: float | None = None  # its first admission to a step
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass(frozen=True, eq=False)  # identity: one request, whatever its fields
class Request:
    """What one request asks, fixed from its admission to its end: its ids, prompt, adapter, sampling
    parameters and the key of its draws, who it is billed to, and its bounds in tokens and time. Nothing
    that runs it writes here (its ``Sequence`` holds that). A caller that sets one of these fields through
    its ``Sequence`` after admission replaces the request whole (``Sequence``'s setters), never changes it."""

    request_id: str
    adapter: str | None
    prompt_ids: list[int]  # read and sliced as a list, never changed
    params: SamplingParams
    max_total: int  # prompt + completion never exceeds this (max_tokens or context limit)
    arrival: float  # time.monotonic() at its admission
    deadline: float | None = None  # time.monotonic() after which nobody waits for the answer
    tenant: str | None = None  # who the request is billed to (GenerateRequest.tenant); fair shares weigh it
    salt: str = ""  # its own part of its cached blocks' key (GenerateRequest.cache_salt: a tenant's cache scope)
    # The key of every draw this request makes (with the token's position as the counter): its seed if
    # given, else a random one, so that a recomputation after preemption draws the same tokens again.
    sampling_seed: int = 0

    @classmethod
    def new(cls, request_id: str, adapter: str | None, prompt_ids: list[int], params: SamplingParams, max_total: int,
            arrival: float | None = None, deadline: float | None = None, tenant: str | None = None,
            salt: str = "") -> Request:
        """The request, arrived now unless ``arrival`` is given, its draws keyed by its seed or a random one."""
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        return cls(request_id, adapter, prompt_ids, params, max_total, time.monotonic() if arrival is None else arrival,
                   deadline, tenant, salt, seed)


def _request_field(name: str, doc: str) -> property:
    """A field of ``Sequence.request`` read through the sequence (what the scheduler's modules read); setting
    it replaces the request with one that differs in that field."""

    def get(self: Sequence):
        return getattr(self.request, name)

    def put(self: Sequence, value) -> None:
        self.request = replace(self.request, **{name: value})

    return property(get, put, doc=doc)


class Sequence:
    """One request as the engine runs it, in three parts: the request (``request``, immutable: what was asked),
    its progress and place (the attributes below: tokens computed and generated, blocks, row, slot, status;
    progress's one writer is the step's postprocess, progress.py), and its timing (``timing``: when things
    happened, read for metrics and promises). Identity: a sequence is one request, whatever its fields."""

    request_id = _request_field("request_id", "the request's id (Request.request_id)")
    adapter = _request_field("adapter", "the adapter it runs with, None for the base model (Request.adapter)")
    prompt_ids = _request_field("prompt_ids", "its prompt's token ids (Request.prompt_ids)")
    params = _request_field("params", "its sampling parameters (Request.params)")
    max_total = _request_field("max_total", "prompt + completion never exceeds this (Request.max_total)")
    arrival = _request_field("arrival", "time.monotonic() at its admission (Request.arrival)")
    deadline = _request_field("deadline", "after which nobody waits for the answer (Request.deadline)")
    tenant = _request_field("tenant", "who it is billed to (Request.tenant)")
    sampling_seed = _request_field("sampling_seed", "the key of its draws (Request.sampling_seed)")
    request_salt = _request_field("salt", "its own part of its cached blocks' key (Request.salt)")

    def __init__(self, request_id: str, adapter: str | None, prompt_ids: list[int], params: SamplingParams,
                 max_total: int, arrival: float | None = None, deadline: float | None = None, tenant: str | None = None,
                 *, request_salt: str = "", request: Request | None = None,
                 status: SequenceStatus = SequenceStatus.WAITING, output_ids: list[int] | None = None,
                 pending: int = 0, num_computed: int = 0, block_table: list[int] | None = None, kv_row: int = -1,
                 cache_salt: str = "", prefix_ids: list[int] | None = None, slot: int = -1,
                 finish_reason: FinishReason | None = None, grammar: GrammarState | None = None,
                 started_at_standing: float | None = None, started_at_computed: int = 0,
                 timing: Timing | None = None) -> None:
        """The sequence of a new request (``Request.new`` of the first arguments), or of ``request`` where
        given (the first arguments are then not read); the keywords after it set its progress."""
        self.request = request or Request.new(request_id, adapter, prompt_ids, params, max_total, arrival, deadline,
                                              tenant, request_salt)
        # ---- progress and place ----
        self.status = status
        self.output_ids: list[int] = output_ids if output_ids is not None else []
        # How many of the last output_ids are PENDING: sampled by a step whose ids the host has not read yet.
        # Each is appended by the step's postprocess at launch and settled (Scheduler.settle) when its id is read.
        self.pending = pending
        # Tokens whose K/V are in the cache. One writer: the step's postprocess (Scheduler.postprocess), which
        # adds a step's chunk (and the cached tokens found at admission) and sets 0 after a preemption.
        self.num_computed = num_computed
        self.block_table: list[int] = block_table if block_table is not None else []
        self.kv_row = kv_row  # its row of the block manager's table while it holds blocks
        # what its cached blocks are keyed under besides their tokens (adapter content, precision, its salt)
        self.cache_salt = cache_salt
        # content id of each leading full block in the prefix cache
        self.prefix_ids: list[int] = prefix_ids if prefix_ids is not None else []
        self.slot = slot  # adapter slot while running, -1 = base model
        self.finish_reason = finish_reason
        self.grammar = grammar  # a constrained request's matcher; advanced by postprocess only
        # its tenant's fair-share standing, and its tokens in the KV cache (computed or cached), when it last
        # started running
        self.started_at_standing = started_at_standing
        self.started_at_computed = started_at_computed
        # ---- timing ----
        self.timing = timing if timing is not None else Timing()

    @classmethod
    def of(cls, request: Request, **progress) -> Sequence:
        """A sequence of ``request`` (its fields are not copied: sequences of one request share it), with
        ``progress`` as ``__init__``'s keywords after ``request`` set it."""
        return cls(request.request_id, request.adapter, request.prompt_ids, request.params, request.max_total,
                   request=request, **progress)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, adapter={self.adapter!r}, {self.status.value}, "
                f"{self.num_computed}/{self.num_tokens} computed, slot {self.slot}, row {self.kv_row})")

    @property
    def all_ids(self) -> list[int]:
        return self.request.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_ids[start:end]`` without copying the whole context."""
        prompt = self.request.prompt_ids
        n = len(prompt)
        if start >= n:
            return self.output_ids[start - n : end - n]
        return prompt[start:end] + self.output_ids[: max(0, end - n)]

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)

    @property
    def num_known(self) -> int:
        """Tokens whose ids the host holds: the prompt and every output but the pending ones."""
        return self.num_tokens - self.pending

    @property
    def num_uncomputed(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
