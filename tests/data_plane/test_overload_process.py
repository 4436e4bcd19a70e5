"""A real pod process under overload, driven over gRPC: a flood on one adapter does not delay another
adapter's first token, a request whose deadline the pod cannot meet is refused at once with a
retry hint, the queue unchanged, a long prompt beside running streams is prefilled at their pace, and
beside the streams of a flood the pod turns away faster.

Delays are counted in engine steps (the pod's lorafleet_engine_step_seconds_count), not seconds, so
the bounds hold on any CPU; the wall-clock figures are benchmarks/overload.py's."""

from __future__ import annotations

import threading

import grpc
import pytest

from benchmarks.processes import PodProcess, wait_until
from conventions.status import retry_after_s
from data_plane.demo_adapters import DEMO_ADAPTERS, demo_adapter_dir
from tests.grpc_helpers import request

pytestmark = pytest.mark.slow

STEPS = "lorafleet_engine_step_seconds_count"


@pytest.fixture(scope="module")
def pod(demo_model_dir, tmp_path_factory):
    """Four sequences per step; no --max-queue-delay, so only a caller's deadline refuses."""
    process = PodProcess(tmp_path_factory.mktemp("overload"), "--max-loras", "2", "--max-cpu-loras", "4",
                         "--max-num-seqs", "4", "--num-kv-blocks", "512", "--max-lora-rank", "16",
                         "--max-queue-delay", "0", "--adapter-root", str(demo_adapter_dir(DEMO_ADAPTERS[0]).parent))
    try:
        yield process.start()
    finally:
        process.stop()


class Flood:
    """``n`` streams of ``adapter`` (max_tokens each, EOS ignored) read on threads until cancelled."""

    def __init__(self, pod, adapter: str | None, n: int, max_tokens: int) -> None:
        self.calls = [pod.generation().Generate(request(f"Story number {i}, please.", adapter, max_tokens=max_tokens,
                                                        ignore_eos=True), timeout=300) for i in range(n)]
        self.threads = [threading.Thread(target=self._drain, args=(call,), daemon=True) for call in self.calls]
        for thread in self.threads:
            thread.start()

    @staticmethod
    def _drain(call) -> None:
        try:
            for _ in call:
                pass
        except grpc.RpcError:
            pass

    def stop(self) -> None:
        for call in self.calls:
            call.cancel()
        for thread in self.threads:
            thread.join(timeout=30)


def steps_to_first_token(pod, adapter: str | None) -> int:
    """Engine steps between sending a short request and its first token."""
    before = pod.metric(STEPS)
    call = pod.generation().Generate(request("Say hello.", adapter, max_tokens=2), timeout=300)
    next(call)
    after = pod.metric(STEPS)
    call.cancel()
    return int(after - before)


def seats_full(pod, running: int, waiting: int) -> bool:
    s = pod.state()
    return s.running_requests == running and s.waiting_requests == waiting


def idle(pod) -> bool:
    s = pod.state()
    return s.running_requests == 0 and s.waiting_requests == 0


def prefill_steps(pod, prompt: str, adapter: str | None) -> tuple[float, float]:
    """(engine steps until the first token of ``prompt``, the largest step budget the pod reported while it
    was prefilled: the prompt tokens a step may carry at the running streams' pace)."""
    steps_before = pod.metric(STEPS)
    budgets: list[float] = []
    prefilled = threading.Event()

    def sample() -> None:
        while not prefilled.wait(0.02):
            budgets.append(pod.metric("lorafleet_step_prefill_budget_tokens"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    call = pod.generation().Generate(request(prompt, adapter, max_tokens=2), timeout=300)
    next(call)
    prefilled.set()
    sampler.join()
    steps = pod.metric(STEPS) - steps_before
    call.cancel()
    return steps, max(budgets, default=pod.metric("lorafleet_step_prefill_budget_tokens"))


def decoding(pod) -> None:
    """Returns once the requests seated now are past their prompts: two more steps."""
    steps = pod.metric(STEPS)
    wait_until(lambda: pod.metric(STEPS) >= steps + 2, 60, "two steps")


def test_a_flood_on_one_adapter_leaves_another_adapters_first_token_a_step_or_two_away(pod):
    unloaded = [steps_to_first_token(pod, "shouty") for _ in range(3)]
    flood = Flood(pod, "pirate", n=16, max_tokens=48)  # four seats: twelve pirate requests queue
    try:
        wait_until(lambda: pod.state().waiting_requests >= 8, 60, "the pirate flood queued")
        loaded = [steps_to_first_token(pod, "shouty") for _ in range(3)]
        wait_until(lambda: pod.state().waiting_requests >= 4, 1, "the flood still queued")
        flood_newcomer = steps_to_first_token(pod, "pirate")  # behind the rest of its own tenant's backlog
    finally:
        flood.stop()
    wait_until(lambda: idle(pod), 60, "pod idle after the flood")
    # Unloaded, a first token takes the step that prefills it (one more when a step was already running).
    # Under the flood shouty takes a seat from pirate at the next step: at most two steps more than alone.
    assert max(loaded) <= max(unloaded) + 2, (unloaded, loaded)
    # The flood's own newcomer waits for its backlog: what first come, first served would do to everyone.
    assert flood_newcomer >= 4 * max(loaded), (loaded, flood_newcomer)


def test_a_request_that_cannot_start_before_its_deadline_is_refused_at_once_with_a_retry_hint(pod):
    # Base-model requests: four hold the seats for ~1000 steps each, two queue. A request of the base model
    # waits for seats to turn over, far beyond a 1 s deadline on any CPU.
    steps_before = pod.metric(STEPS)
    flood = Flood(pod, None, n=6, max_tokens=1000)
    try:
        # all six arrived, four decoding (the module's pod has stepped before: count steps from here)
        wait_until(lambda: seats_full(pod, running=4, waiting=2) and pod.metric(STEPS) > steps_before + 1, 60,
                   "seats full")
        refused_before = pod.metric("lorafleet_requests_refused_total", reason="deadline")
        with pytest.raises(grpc.RpcError) as e:
            list(pod.generation().Generate(request("Say hello.", max_tokens=2), timeout=1.0))
        waiting = pod.state().waiting_requests
        refused_after = pod.metric("lorafleet_requests_refused_total", reason="deadline")
        # without a deadline the same request is queued (this pod has no --max-queue-delay)
        patient = pod.generation().Generate(request("Say hello.", max_tokens=2), timeout=300)
        wait_until(lambda: pod.state().waiting_requests == 3, 10, "the patient request queued")
        patient.cancel()
    finally:
        flood.stop()
    wait_until(lambda: idle(pod), 60, "pod idle after the flood")
    # refused, not timed out: a call still waiting at its 1 s deadline would end DEADLINE_EXCEEDED
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    assert "after its deadline" in e.value.details() and "another pod" in e.value.details()
    hint = retry_after_s(e.value.trailing_metadata())
    assert hint is not None and 0.05 <= hint <= 60
    assert waiting == 2 and refused_after == refused_before + 1



class Counted(Flood):
    """Flood streams that count the tokens each has received."""

    def __init__(self, pod, n: int, max_tokens: int) -> None:
        self.tokens = [0] * n
        super().__init__(pod, None, n, max_tokens)

    def _drain(self, call) -> None:  # type: ignore[override]
        i = self.calls.index(call)
        try:
            for _ in call:
                self.tokens[i] += 1
        except grpc.RpcError:
            pass


def test_a_long_prompt_arriving_mid_stream_is_chunked_while_running_streams_get_a_token_every_step(
        pod, demo_tokenizer):
    streams = Counted(pod, n=2, max_tokens=2000)
    # ~900 tokens: one step could hold them (--max-num-batched-tokens 1024), but beside two decodes a step
    # may prefill far fewer on a CPU (the step-time model keeps the step within --itl-growth of its decodes)
    long_prompt = " ".join(["tomorrow the lighthouse keeper counts gulls"] * 130)
    prompt_tokens = len(demo_tokenizer.encode(long_prompt))
    assert 800 < prompt_tokens < 1024
    try:
        wait_until(lambda: min(streams.tokens) >= 2, 60, "both streams decoding")
        tokens_before = list(streams.tokens)
        steps, budget = prefill_steps(pod, long_prompt, None)
        got = [after - before for after, before in zip(streams.tokens, tokens_before, strict=True)]
    finally:
        streams.stop()
    wait_until(lambda: idle(pod), 60, "pod idle after the streams")
    # the prompt was prefilled in chunks over several steps, not in one step that stalls the streams: about
    # as many as its tokens need at the largest budget seen beside two decodes while it was prefilled (the
    # budget is refitted as steps are timed; 10% of slack for a step the sampling missed)
    assert 0 < budget < prompt_tokens and steps >= max(2, 0.9 * prompt_tokens / budget), (steps, budget)
    # and every step of it gave each stream its token (the counts are read a step or two apart)
    assert min(got) >= steps - 3, (steps, got)


@pytest.fixture(scope="module")
def short_queue_pod(demo_model_dir, tmp_path_factory):
    """Four sequences per step and four waiting: the fifth to eighth request of a flood wait, a ninth is
    turned away (queue full)."""
    process = PodProcess(tmp_path_factory.mktemp("short-queue"), "--max-loras", "2", "--max-cpu-loras", "4",
                         "--max-num-seqs", "4", "--max-waiting", "4", "--num-kv-blocks", "512",
                         "--max-lora-rank", "16", "--max-queue-delay", "0",
                         "--adapter-root", str(demo_adapter_dir(DEMO_ADAPTERS[0]).parent))
    try:
        yield process.start()
    finally:
        process.stop()


def test_a_flood_the_pod_turns_away_lets_another_adapters_long_prompt_past_its_streams_pace(
        short_queue_pod, demo_tokenizer):
    pod = short_queue_pod
    # two prompts of one length, different from their first token (the second finds nothing of the first
    # in the prefix cache)
    prompts = [" ".join([words] * 30) for words in ("the ferry to the northern islands leaves at dawn",
                                                     "a lantern burns in the harbour master's window")]
    prompt_tokens = len(demo_tokenizer.encode(prompts[0]))
    assert 200 < prompt_tokens < 1024 and len(demo_tokenizer.encode(prompts[1])) == prompt_tokens
    # beside streams of the base model, which the pod never turned away: the streams' pace holds
    streams = Flood(pod, None, n=4, max_tokens=2000)
    try:
        wait_until(lambda: seats_full(pod, running=4, waiting=0), 60, "four base-model streams")
        decoding(pod)
        steady_steps, steady_budget = prefill_steps(pod, prompts[0], DEMO_ADAPTERS[1])
    finally:
        streams.stop()
    wait_until(lambda: idle(pod), 60, "pod idle after the streams")
    # beside a flood of another adapter, turned away once its queue is full
    # (600 tokens each: long enough to outlast the test, short enough that the queue's last request is
    # estimated to start well within the streams' 300 s deadline and is queued, not refused)
    flood = [Flood(pod, DEMO_ADAPTERS[0], n=4, max_tokens=600)]
    try:
        wait_until(lambda: seats_full(pod, running=4, waiting=0), 60, "the flood seated")
        decoding(pod)
        for waiting in range(1, 5):  # one at a time, each queued before the next is sent
            flood.append(Flood(pod, DEMO_ADAPTERS[0], n=1, max_tokens=600))
            wait_until(lambda n=waiting: seats_full(pod, running=4, waiting=n), 60, f"{waiting} of the flood queued")
        with pytest.raises(grpc.RpcError) as e:
            list(pod.generation().Generate(request("One more, please.", DEMO_ADAPTERS[0], max_tokens=2), timeout=30))
        flood.pop().stop()  # a place in the queue for the other adapter's request
        wait_until(lambda: seats_full(pod, running=4, waiting=3), 10, "a place in the queue")
        flooded_steps, flooded_budget = prefill_steps(pod, prompts[1], DEMO_ADAPTERS[1])
    finally:
        for streams in flood:
            streams.stop()
    wait_until(lambda: idle(pod), 60, "pod idle after the flood")
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue holds 4" in e.value.details()
    # at the streams' pace the prompt takes about as many steps as its tokens need at that budget (10% of
    # slack for a step the sampling missed); beside the turned-away flood fewer than its streams' pace allows
    for budget in (steady_budget, flooded_budget):
        assert 0 < budget < prompt_tokens, (steady_budget, flooded_budget)
    assert steady_steps >= max(2, 0.9 * prompt_tokens / steady_budget), (steady_steps, steady_budget)
    assert flooded_steps < 0.9 * prompt_tokens / flooded_budget, (flooded_steps, flooded_budget)
