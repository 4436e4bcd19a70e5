"""The engine: admits requests, and one asyncio task loops schedule() -> run() -> postprocess().

Scheduling and bookkeeping happen on the event loop; the forward pass runs on one model thread
under ``model_lock``. ``adapters`` (an AdapterLoader) loads, unloads and pins adapters off the
step loop, and takes that lock for every cache operation that may copy into or clear adapter
slots, so none races with a forward.

Asynchronous scheduling (the default; ``async_scheduling=False`` keeps the synchronous loop): step N+1
is scheduled while step N runs, and launched once N is (on CUDA once N's kernels are queued, on the CPU
once N is computed); N's tokens are then read with one copy and postprocessed while N+1 runs. A step's
postprocess records its progress when it launches (its sampled tokens joining their outputs as
``PENDING``) and settles each token's id when it is read, so N+1 is scheduled on N's progress; a
sequence that decodes a pending token reads it on the device, at its row of the persistent batch (where N
wrote it; persistent_batch.py). A sequence that N ends (a stop, EOS, its grammar's end) may still hold a
slot in N+1: that output is dropped, never streamed or counted. A step waits for N's tokens instead when
one of its constrained sequences decodes a pending token (its grammar mask needs the matcher to have
consumed it), and when an adapter load waits for the model lock (the lock is let go between the two
steps). Tokens are the same bits in both loops: a request's tokens do not depend on what shares its steps.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from conventions.prefix_chain import RoutingPrefix
from data_plane.engine.adapter_loader import AdapterLoader, Resolver
from data_plane.engine.admission import DelayEstimator, Load, lateness, promise_s, retry_after
from data_plane.engine.block_manager import BlockManager
from data_plane.engine.fair_share import account_of
from data_plane.engine.grammar import GrammarCompiler
from data_plane.engine.model_runner import ModelRunner, StepTokens
from data_plane.engine.output import OutputText
from data_plane.engine.prefix_report import PrefixReport
from data_plane.engine.progress import ScheduledSeq, step_shape
from data_plane.engine.scheduler import Policy, Scheduler, SchedulerLimits
from data_plane.engine.sequence import PENDING, FinishReason, SamplingParams, Sequence, Timing, TokenOut
from data_plane.engine.state import EngineState, PrefixState
from data_plane.engine.step_cost import DEFAULT_ITL_GROWTH, StepCost, StepShape
from data_plane.engine.threads import model_thread
from data_plane.errors import (
    DeadlineExceeded,
    InvalidRequest,
    LorafleetError,
    Overloaded,
    QueueFull,
    ShuttingDown,
    StepFailed,
)
from data_plane.lora.adapter_cache import Tier
from data_plane.lora.runtime import LoraRuntime
from data_plane.metrics import PodMetrics
from data_plane.model.llama import LlamaForCausalLM
from data_plane.model.tokenizer import Tokenizer

log = logging.getLogger("lorafleet.engine")


@dataclass(frozen=True)
class EngineLimits:
    """The engine's bounds, every one given by the pod (build_engine); their defaults are DataPlaneConfig's."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting: int
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    max_queue_delay_s: float  # longest estimated wait for a first token a new request is admitted with; 0 = any
    target_itl_s: float = 0.0  # the step time prefill may fill up to; 0 = relative, by itl_growth (step_cost.py)
    itl_growth: float = DEFAULT_ITL_GROWTH  # a step that prefills lasts ≤ this × its decodes; 0 = the knee

    def __post_init__(self) -> None:
        if min(self.max_num_seqs, self.max_num_batched_tokens, self.block_size, self.num_kv_blocks) <= 0:
            raise ValueError("engine limits must be positive")
        if not self.max_queue_delay_s >= 0:
            raise ValueError("max_queue_delay_s must be >= 0 (0 = no limit)")


@dataclass(frozen=True)
class StepOutput:
    text: str
    tokens: tuple[TokenOut, ...]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class _Stream:
    seq: Sequence
    text: OutputText
    queue: asyncio.Queue  # StepOutput | LorafleetError


@dataclass
class _Flight:
    """A launched step whose tokens are not postprocessed yet."""

    batch: list[ScheduledSeq]  # its items, each with a live sequence when it launched
    execution: asyncio.Future  # the model thread's execute: its StepTokens once launched (CUDA) or computed (CPU)
    shape: StepShape
    started: float  # time.monotonic() at its launch


class ModelLock(asyncio.Lock):
    """The model lock, counting the tasks waiting for it: the asynchronous step loop keeps it from one step to
    the next while steps are in flight, and lets it go between two steps when another task waits."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = 0

    async def acquire(self) -> bool:
        self.waiting += 1
        try:
            return await super().acquire()
        finally:
            self.waiting -= 1


class Engine:
    def __init__(self, model: LlamaForCausalLM, tokenizer: Tokenizer, lora: LoraRuntime, limits: EngineLimits,
                 resolver: Resolver, metrics: PodMetrics, weights: Mapping[str | None, float] | None = None,
                 policy: Policy = Policy.FAIR, cuda_graphs: bool = False, prefix_caching: bool = True,
                 precision: str | None = None, prefix_report_size: int = 0, compute_threads: int | None = None,
                 async_scheduling: bool = True) -> None:
        """``weights``: each adapter's fair share of the steps relative to the others (default 1.0; None
        names the base model); ``policy``: the order waiting requests are admitted in; ``cuda_graphs``:
        every step is padded to a bucket and replays a CUDA graph captured by ``warm_up.warm_up`` (on a CUDA
        model); ``prefix_caching``:
        full KV blocks are kept and reused by requests whose prompts begin alike, keyed also by
        ``precision`` (default: the weights' dtype) and each adapter's content; ``prefix_report_size``: how
        many routing-prefix hashes ``prefix_report`` keeps for routers (0: none; needs prefix caching);
        ``compute_threads``: the torch threads the model thread computes on (None: torch's count for a new
        thread; a pod passes its own and keeps its other threads on one, see ``threads``); ``async_scheduling``:
        the next step is scheduled and launched while one runs (the module's docstring), else each step's tokens
        are postprocessed before the next is scheduled."""
        self.model = model
        self.tokenizer = tokenizer
        self.lora = lora
        self.limits = limits
        self.metrics = metrics
        max_blocks_per_seq = min(limits.num_kv_blocks, -(-limits.max_model_len // limits.block_size))
        self.blocks = BlockManager(limits.num_kv_blocks, limits.block_size, limits.max_num_seqs, max_blocks_per_seq,
                                   prefix_caching)
        self.precision = precision or str(model.embed_tokens.weight.dtype).removeprefix("torch.")
        self.prefix_report = PrefixReport(self.blocks.prefix, prefix_report_size) \
            if self.blocks.prefix is not None and prefix_report_size > 0 else None
        self.runner = ModelRunner(model, lora, model.new_kv_cache(limits.num_kv_blocks, limits.block_size), self.blocks,
                                  limits.max_num_seqs, limits.max_num_batched_tokens, graphs=cuda_graphs)
        self.model_lock = ModelLock()
        self.async_scheduling = async_scheduling
        self._flights = 0  # steps launched and not yet completed; the loop holds the model lock while any are
        self._last_step_end = 0.0  # time.monotonic() when the last step's tokens were read
        self._last_shape = StepShape(0, 0, 0, 0)  # the shape of the step launched last
        self.adapters = AdapterLoader(lora, resolver, metrics, self.model_lock, self._adapter_load_ended)
        self.costs = StepCost(limits.target_itl_s, limits.max_num_batched_tokens, limits.itl_growth,
                              row_tile=model.row_tile)
        self.scheduler = Scheduler(SchedulerLimits(limits.max_num_seqs, limits.max_num_batched_tokens),
                                   self.blocks, lora.cache, self.adapters.is_resident, weights, policy,
                                   self._prefix_salt, self.costs.prefill_budget, step_time=self.costs.predict)
        self.grammars = GrammarCompiler(tokenizer.to_json, model.config.vocab_size, tokenizer.eos_token_ids,
                                        metrics.grammar_compile.observe)
        self.delays = DelayEstimator(self.costs)
        # Every step runs on this one thread: per-thread state of the math libraries (oneDNN's
        # kernels and scratch buffers, the allocator's arenas, OpenMP's team) then exists once, not once per worker.
        self._model_thread = model_thread(compute_threads)
        self._streams: dict[str, _Stream] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._last_progress = time.monotonic()  # see last_progress
        self.accepting = True

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="engine-loop")

    @property
    def last_progress(self) -> float:
        """``time.monotonic()`` when the step loop last began an iteration: it finished a step, or
        found nothing it could run (then it waits at most half a second). The pod's watchdog
        compares it with now while requests are running or waiting."""
        return self._last_progress

    async def drain(self, grace_s: float) -> None:
        """Stops accepting requests and waits up to ``grace_s`` for in-flight ones to finish."""
        self.accepting = False
        deadline = time.monotonic() + grace_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self.abort(request_id, ShuttingDown("the pod shut down before the request finished; retry elsewhere"))

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._model_thread.shutdown(wait=False)

    # ---- requests ------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None,
                       request_id: str | None = None, timeout_s: float | None = None,
                       tenant: str | None = None, routing: RoutingPrefix | None = None,
                       cache_salt: str = "") -> AsyncIterator[StepOutput]:
        """Streams the completion of ``prompt_ids``. Raises a LorafleetError before the first
        output for a bad request, or for one whose estimated first token comes after ``timeout_s`` (the
        caller's deadline; None: none) or after --max-queue-delay (``admission.lateness``; Overloaded, with
        a retry hint); a request still
        waiting when its deadline passes ends with DeadlineExceeded. Closing the iterator aborts the
        request and frees its blocks. ``tenant``: who the request is billed to; a tenant's requests share one
        fair share whatever their adapters. ``routing``: the request's routing prefix, recorded in
        ``prefix_report`` once its prompt is prefilled. ``cache_salt``: its prompt's cached blocks are shared only
        with requests of the same salt (GenerateRequest.cache_salt: a tenant's cache scope)."""
        request_id = request_id or uuid.uuid4().hex
        seq = self._admit(request_id, prompt_ids, params, adapter, timeout_s, tenant or None)
        seq.request_salt = cache_salt
        # its first token waits for its adapter's load, which the estimate does not foresee: it teaches the
        # estimate nothing about the queue
        seq.timing.waited_for_adapter = adapter is not None and not self.adapters.is_resident(adapter)
        if params.constraint is not None:  # INVALID_ARGUMENT for what the grammar engine cannot honour, here
            seq.grammar = await asyncio.get_running_loop().run_in_executor(None, self.grammars.state, params.constraint)
            self.metrics.constrained_requests.labels(params.constraint.kind.value).inc()
        stream = _Stream(seq, OutputText(self.tokenizer, params.stop), asyncio.Queue())
        if adapter is not None:
            await self.adapters.ensure(adapter)  # NOT_FOUND surfaces here, before anything is queued
        self.scheduler.add(seq)  # CapacityExceeded if every slot holds another pinned adapter
        self._streams[request_id] = stream
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        self._wakeup.set()
        outcome = "aborted"
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, LorafleetError):
                    outcome = "error"
                    raise item
                if routing is not None and self.prefix_report is not None:
                    self._report_prefix(seq, routing)
                    routing = None
                yield item
                if item.finish_reason is not None:
                    outcome = item.finish_reason.value
                    return
        finally:
            self.metrics.requests.labels(outcome).inc()
            self.abort(request_id)

    def abort(self, request_id: str, error: LorafleetError | None = None) -> None:
        """Ends a request now, freeing its KV blocks and adapter slot."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream.seq.finish_reason = stream.seq.finish_reason or FinishReason.ABORTED
        self.scheduler.finish(stream.seq)
        if error is not None:
            stream.queue.put_nowait(error)
        self._wakeup.set()

    def _admit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, adapter: str | None,
               timeout_s: float | None, tenant: str | None) -> Sequence:
        if not self.accepting:
            raise ShuttingDown("this pod is shutting down; send the request to another pod")
        if request_id in self._streams:
            raise InvalidRequest(f"request_id {request_id!r} is already in flight; use a unique id")
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty; send a prompt or messages")
        limit = min(self.limits.max_model_len, self.limits.num_kv_blocks * self.limits.block_size)
        if len(prompt_ids) >= limit:
            raise InvalidRequest(f"the prompt has {len(prompt_ids)} tokens; this pod accepts at most {limit - 1}")
        bad = [t for t in prompt_ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (0..{self.model.config.vocab_size - 1})")
        bad = [t for t, _ in params.logit_bias if not 0 <= t < self.model.config.vocab_size]
        if bad:
            raise InvalidRequest(f"logit_bias names token id {bad[0]}, outside the vocabulary "
                                 f"(0..{self.model.config.vocab_size - 1})")
        load = self.scheduler.load()
        calibration = self.delays.calibration(account_of(adapter, tenant))  # read once: tail, and the bias kept
        tail = calibration.tail()
        wait_s, own_s = self._estimate_first_token(adapter, tenant, len(prompt_ids), load, timeout_s, tail)
        if self.scheduler.num_waiting >= self.limits.max_waiting:
            self.metrics.refusals.labels("queue_full").inc()
            self.scheduler.turned_away(adapter, tenant)
            raise QueueFull(f"the queue holds {self.limits.max_waiting} waiting requests; retry later or on "
                            "another pod", retry_after_s=retry_after(wait_s, 0.0))
        # a step kept before the promise ends, so that a slightly late estimate does not rush the steps of
        # running streams (with none running, a rush costs nobody anything)
        keep_s = self.costs.step_target(load.running_decodes, load.adapters) if load.running_decodes else 0.0
        late = lateness(wait_s, own_s, tail, self.limits.max_queue_delay_s, timeout_s, keep_s)
        if late is not None:
            self.metrics.refusals.labels(late.reason).inc()
            if late.reason == "queue_delay":  # past what the pod promises (a caller's own deadline is no flood)
                self.scheduler.turned_away(adapter, tenant)
            if log.isEnabledFor(logging.DEBUG):  # what the estimate saw, for --log-level DEBUG
                log.debug("refused a request (adapter %s, tenant %s, %d prompt tokens): first token estimated in "
                          "%.2f s, %.2f s of it its own prefill; %s", adapter, tenant or "-", len(prompt_ids), wait_s,
                          own_s, load)
            raise Overloaded(late.message, retry_after_s=late.retry_after_s)
        max_total = limit if params.max_tokens == 0 else min(limit, len(prompt_ids) + params.max_tokens)
        now = time.monotonic()
        deadline = None if timeout_s is None else now + timeout_s
        promised = promise_s(own_s * tail, self.limits.max_queue_delay_s)
        return Sequence(request_id, adapter, list(prompt_ids), params, max_total, arrival=now, deadline=deadline,
                        tenant=tenant, timing=Timing(ttft_estimate=wait_s, ttft_bias=calibration.bias,
                                                     first_token_due=None if promised is None else now + promised))

    def _estimate_first_token(self, adapter: str | None, tenant: str | None, prompt_tokens: int, load: Load,
                              timeout_s: float | None, tail: float) -> tuple[float, float]:
        """(seconds until a new request's first token, the part of them its own prefill takes), as
        admission judges them (``tail``: ``Calibration.tail``, read once per request): where the plan of the
        queue (``queue_plan.py``, the scheduler's own rules followed step by step, later arrivals included)
        lands it, followed up to what admission would allow (the rest counted at the last step's rate: the
        refusal is certain and its hint needs no more)."""
        account = account_of(adapter, tenant)
        own_s = self.delays.own_prefill(prompt_tokens, load, account, adapter)
        promised = promise_s(own_s * tail, self.limits.max_queue_delay_s)
        enough_s = min(math.inf if timeout_s is None else timeout_s, math.inf if promised is None else promised) / tail
        if self.delays.costs.coef is None:  # nothing timed yet: nothing to plan with
            return 0.0, own_s
        begins_s = self.delays.in_flight_s()
        horizon_s = enough_s / self.delays.calibration(account).bias - begins_s
        landing = self.scheduler.plan(begins_s).landing(adapter, tenant, prompt_tokens, horizon_s)
        return self.delays.first_token(landing, account), own_s

    def _adapter_load_ended(self, name: str, error: LorafleetError | None) -> None:
        # a failed load ends the requests waiting for that adapter; any end lets the scheduler look again
        if error is not None:
            for stream in [s for s in self._streams.values() if s.seq.adapter == name and s.seq.slot < 0]:
                self.abort(stream.seq.request_id, error)
        self._wakeup.set()

    def _report_prefix(self, seq: Sequence, routing: RoutingPrefix) -> None:
        """Records the routing prefix of ``seq``, whose prompt is prefilled: its full blocks are cached (or
        were, and have since been evicted for another use, which the report then leaves out)."""
        prompt = seq.prompt_ids
        cached = self.blocks.prefix.match(seq.cache_salt, prompt, len(prompt))
        self.prefix_report.record(routing, len(prompt), [content for content, _ in cached])

    def _prefix_salt(self, seq: Sequence) -> str:
        """What a request's cached prefix blocks are keyed under besides their tokens: the pod's precision,
        its adapter's content (the sha256 of its weights) and its own salt (a tenant's cache scope), so no block
        is shared across any of them."""
        adapter = "" if seq.adapter is None else self.lora.cache.get(seq.adapter).sha256
        return f"{self.precision}/{adapter}" + (f"/{seq.request_salt}" if seq.request_salt else "")

    # ---- the step loop ---------------------------------------------------------------------
    async def _loop(self) -> None:
        flight: _Flight | None = None  # the step launched last, its tokens not yet postprocessed (asynchronous)
        while True:
            self._last_progress = time.monotonic()
            self._end_what_cannot_run(self._last_progress)
            batch = self.scheduler.schedule() if self.scheduler.has_work() else []
            if flight is not None and not (batch and await self._overlaps(flight, batch)):
                await self._complete(flight)
                flight = None
                if not batch:  # what it ended or settled may let the scheduler take more now
                    continue
            if not batch:
                # a step that runs nothing may still have preempted: those may start at the next step, at once
                if not self.scheduler.postprocess([], []):
                    await self._idle()
                continue
            launched = await self._launch(batch)
            if flight is not None:
                await self._complete(flight)
            flight = launched
            if flight is not None and not self.async_scheduling:
                await self._complete(flight)
                flight = None

    async def _overlaps(self, flight: _Flight, batch: list[ScheduledSeq]) -> bool:
        """Whether ``batch`` may launch before ``flight``'s tokens are read: no other task waits for the model
        lock, none of its constrained sequences decodes a token still pending (the matcher must consume it
        before the mask is made), and ``flight`` launched without error (awaited here: the next step's
        inputs are written behind it)."""
        if self.model_lock.waiting or any(item.seq.grammar is not None and item.seq.pending for item in batch):
            return False
        try:
            await flight.execution
        except Exception:  # noqa: BLE001 - _complete reports it and ends its requests
            return False
        return True

    def _end_what_cannot_run(self, now: float) -> None:
        """Ends waiting requests that can no longer run (pins changed, deadline passed) and loads again
        the adapters of waiting requests that were evicted from the CPU tier meanwhile."""
        for seq, error in self.scheduler.refused():  # pins changed: these can never get a slot now
            self.abort(seq.request_id, error)
        for seq in self.scheduler.expired(now):
            self.metrics.refusals.labels("expired").inc()
            self.abort(seq.request_id, DeadlineExceeded(
                f"the request's deadline passed after {now - seq.arrival:.2f} s in the queue; nothing was "
                "generated: retry with a longer deadline or on a less loaded pod"))
        self.adapters.reload_missing(seq.adapter for seq in self.scheduler.waiting if seq.adapter is not None)

    async def _idle(self) -> None:
        """Waits for a new request, an end or an adapter load, or half a second."""
        self._wakeup.clear()
        try:
            async with asyncio.timeout(0.5):
                await self._wakeup.wait()
        except TimeoutError:
            pass

    async def _launch(self, batch: list[ScheduledSeq]) -> _Flight | None:
        """Starts the step of ``batch`` on the model thread under the model lock, and records its progress
        (the step's postprocess, first half: each sampled token joins its output as PENDING). Its inputs
        are read here, on the loop, so that a request's end during the forward frees nothing it reads.
        None when nothing was launched: every request in it ended while the lock was awaited, or its inputs
        could not be built (which ends them all)."""
        started = time.monotonic()
        if not self._flights:
            await self.model_lock.acquire()
        self._flights += 1
        live = [item for item in batch if not item.seq.is_finished]
        try:
            step = self.runner.prepare(live) if live else None
        except Exception as e:  # noqa: BLE001 - one bad step must not stop the pod
            self._fail(live, e)
            step = None
        if step is None:
            self._landed()
            self.scheduler.postprocess([], [])
            return None
        tokens: list[int | None] = [PENDING] * len(live) if step.whole else [None] * len(live)
        if not step.whole:
            for k in step.sampled_positions:
                tokens[k] = PENDING
        shape = self._last_shape = step_shape(live)
        self.delays.step_began(shape)
        self.scheduler.postprocess(live, tokens, ran=False)
        execution = asyncio.get_running_loop().run_in_executor(self._model_thread, self.runner.execute, step)
        return _Flight(live, execution, shape, started)

    async def _complete(self, flight: _Flight) -> None:
        """Reads ``flight``'s tokens (waiting for the device off the loop where they are not copied yet) and
        postprocesses them; a failed step ends its requests."""
        try:
            result: StepTokens = await flight.execution
            tokens = result.tokens() if result.ready() else \
                await asyncio.get_running_loop().run_in_executor(None, result.tokens)
        except Exception as e:  # noqa: BLE001 - one bad step must not stop the pod
            self._fail(flight.batch, e)
            tokens = None
        self._landed()
        if tokens is None:
            return
        now = time.monotonic()
        took, self._last_step_end = now - max(flight.started, self._last_step_end), now
        self._postprocess(flight.batch, tokens)
        self._record_step(flight.shape, took)
        if self._flights:  # the step launched after it runs on from now, as admission's estimate sees it
            self.delays.step_began(self._last_shape)

    def _landed(self) -> None:
        """One step fewer in flight: the model lock goes back once none is."""
        self._flights -= 1
        if not self._flights:
            self.model_lock.release()

    def _fail(self, batch: list[ScheduledSeq], error: Exception) -> None:
        log.error("forward pass failed; ending the %d requests in the step", len(batch), exc_info=error)
        for item in batch:
            self.abort(item.seq.request_id, StepFailed(f"the forward pass failed ({type(error).__name__}: {error}); "
                                                       "retry the request"))

    def _record_step(self, shape: StepShape, took: float) -> None:
        self.metrics.step_duration.observe(took)
        self.delays.observe_step(shape, took)
        if log.isEnabledFor(logging.DEBUG):  # the step-time model against each step, for --log-level DEBUG
            log.debug("step of %d decodes, %d prompt tokens in %d prompts, %d adapters: %.1f ms, model %.1f ms",
                      shape.decode_rows, shape.prefill_tokens, shape.prefill_seqs, shape.adapters, took * 1e3,
                      self.costs.predict(shape) * 1e3)
        self.metrics.prefill_budget.set(self.costs.prefill_budget(shape.decode_rows, shape.adapters))

    def _postprocess(self, batch: list[ScheduledSeq], tokens: list[TokenOut | None]) -> None:
        """The step's tokens (the step's postprocess, second half): each settled in its sequence's output
        with its computed blocks (``Scheduler.settle``, the writer of its progress), streamed, and a sequence
        at a stop, its grammar's end or its length finished. A sequence that ended since the step launched
        (aborted, or finished by the step before, whose tokens were read after this one launched) has its
        token dropped: never settled, streamed or counted."""
        now = time.monotonic()
        delivered = 0
        for item, tok in zip(batch, tokens, strict=True):
            seq = item.seq
            if seq.is_finished:  # ended since the step launched
                continue
            self.scheduler.settle(seq, None if tok is None else tok.id)
            if tok is None:  # a prompt chunk that samples nothing
                continue
            delivered += 1
            self._record_latency(seq, now)
            stream = self._streams[seq.request_id]
            text, stopped = stream.text.push(tok.id)
            reason = None
            complete = seq.grammar is not None and seq.grammar.advance(tok.id)  # a constrained output is whole
            if stopped or complete or (tok.id in self.tokenizer.eos_token_ids and not seq.params.ignore_eos):
                reason = FinishReason.STOP
            elif seq.num_known >= seq.max_total:
                reason = FinishReason.LENGTH
            if reason is not None:
                text += "" if stopped else stream.text.flush()
                seq.finish_reason = reason
                self.scheduler.finish(seq)
                self.metrics.e2e.observe(now - seq.arrival)
            stream.queue.put_nowait(StepOutput(text, (tok,), reason, len(seq.prompt_ids),
                                               seq.num_known - len(seq.prompt_ids)))
        self.metrics.generated_tokens.inc(delivered)

    def _record_latency(self, seq: Sequence, now: float) -> None:
        timing = seq.timing
        if timing.first_token_time is None:
            timing.first_token_time = now
            self.metrics.ttft.labels("adapter" if seq.adapter else "base").observe(now - seq.arrival)
            if log.isEnabledFor(logging.DEBUG):  # where a first token's wait went, for --log-level DEBUG
                log.debug("first token of %s (adapter %s, tenant %s, %d prompt tokens) %.1f ms after arrival, "
                          "%.1f ms of it queued", seq.request_id, seq.adapter, seq.tenant or "-", len(seq.prompt_ids),
                          (now - seq.arrival) * 1e3, (timing.first_scheduled - seq.arrival) * 1e3)
            if timing.ttft_estimate is not None:
                self.metrics.ttft_estimate_error.observe(now - seq.arrival - timing.ttft_estimate)
                if not timing.waited_for_adapter:
                    self.delays.observe_first_token(timing.ttft_estimate, now - seq.arrival,
                                                    account_of(seq.adapter, seq.tenant), timing.ttft_bias)
        else:
            self.metrics.itl.observe(now - timing.last_token_time)
        timing.last_token_time = now

    def on_model_thread(self, fn, *args):
        """``fn(*args)`` run on the model thread, its result returned (start-up work, before ``start``)."""
        return self._model_thread.submit(fn, *args).result()

    def run_alone(self, batch: list[ScheduledSeq]) -> bool:
        """Runs a hand-built ``batch`` with KV blocks it holds only for the step; False, running nothing,
        when they do not fit. For start-up work, before ``start``."""
        try:
            for item in batch:
                if not self.blocks.can_allocate(item.seq, item.num_new):
                    return False
                self.blocks.allocate(item.seq, item.num_new)
            self.on_model_thread(self.runner.run, batch)
            return True
        finally:
            for item in batch:
                self.blocks.free(item.seq)

    # ---- state -----------------------------------------------------------------------------
    def snapshot(self) -> EngineState:
        """The engine's state now: cache tiers, resident adapters, load and eviction counts, queues, KV use."""
        cache = self.lora.cache
        # The cache counts what enters its tiers; a failed load never reaches it, so its count is the loader's.
        loads = {**cache.stats.loads, (Tier.CPU, "error"): self.adapters.failed_loads}
        return EngineState(
            slots=cache.slot_usage(), cpu=cache.cpu_usage(), adapters=tuple(cache.list()), loads=loads,
            evictions=dict(cache.stats.evictions), running=len(self.scheduler.running),
            waiting=self.scheduler.num_waiting, kv_usage=self.blocks.usage,
            preemptions=self.scheduler.num_preemptions, prefix=self._prefix_state(),
            disk=self.lora.downloads.tier.usage() if self.lora.downloads is not None else None,
            eager_steps=self.runner.step_runner.eager_steps,
        )

    def routing_prefixes(self) -> list[int]:
        """The routing-prefix hashes whose KV blocks this pod still holds, least recent first (for
        PodState.prefix_hashes)."""
        return self.prefix_report.held() if self.prefix_report is not None else []

    def _prefix_state(self) -> PrefixState | None:
        prefix = self.blocks.prefix
        if prefix is None:
            return None
        st = prefix.stats
        return PrefixState(prefix.num_cached, st.queried_tokens, st.hit_tokens, st.evictions)

