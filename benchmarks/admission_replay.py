"""How far the admission estimate and the scheduler disagree, without a model or a clock: a replay.

A pod's scheduler and admission estimate (``Scheduler``, ``DelayEstimator`` and the engine's
``_estimate_first_token``, unchanged: the plan of the queue, ``queue_plan.py``) serve an open-loop
mixed-adapter load on a virtual clock, each step lasting what a synthetic device's linear step cost
says (``device_s``; the step-time model is fitted to it, so its predictions are exact). Nothing is
measured in wall time, so the figures are the same on a busy machine as on a quiet one (and run to run
with a fixed ``PYTHONHASHSEED``), and what differs between the estimate and the first token is the
estimate's model of the queue alone: which work goes before a request, in which steps, and which
requests arrive after it. By default no calibration (the pod's correction by how late first tokens came)
is applied, to show the disagreement it would have to correct; ``--calibrated`` applies it and judges
each estimate by the tail of recent lateness as the pod does (``Engine._admit``), which is what a pod's
promise rests on.

Load: Poisson arrivals at each ``--rates`` value (requests a second), each for one of four adapters or
the base model at random, prompts of 10-140 tokens, 16-48 new tokens; refused as the pod refuses at
``--max-queue-delay`` (``admission.lateness``). Per rate: requests, refusals, admitted requests whose
first token came within their promise (``kept``), admitted first-token times (p50, p99, max), first
token over estimate (p50, p90, p99), and the requests whose first token came over twice its estimate
with the later arrivals that started before it while its own prompt had started (a mean).

    PYTHONHASHSEED=0 python benchmarks/admission_replay.py [--rates 1.5 3.5 7] [--seconds 120] [--seed 1]
        [--calibrated]
"""

from __future__ import annotations

import argparse
import random
import time
from types import SimpleNamespace
from unittest import mock

from data_plane.engine.admission import DelayEstimator, lateness, promise_s
from data_plane.engine.block_manager import BlockManager
from data_plane.engine.engine import Engine
from data_plane.engine.fair_share import account_of
from data_plane.engine.progress import step_shape
from data_plane.engine.scheduler import Scheduler, SchedulerLimits
from data_plane.engine.sequence import SamplingParams, Sequence, Timing
from data_plane.engine.step_cost import StepCost, StepShape
from data_plane.lora.adapter_cache import AdapterCache
from data_plane.lora.peft_adapter import LoraAdapter

MAX_NUM_SEQS, MAX_BATCHED_TOKENS = 16, 512
FLOWS = (None, "a", "b", "c", "d")


def device_s(shape: StepShape) -> float:
    """The synthetic device: a fixed cost, and per decode row, prompt token, prefilling sequence and adapter."""
    return (0.020 + 0.0015 * shape.decode_rows + 0.0006 * shape.prefill_tokens + 0.004 * shape.prefill_seqs
            + 0.003 * shape.adapters)


def replay(rate: float, seconds: float, seed: int, max_queue_delay_s: float,
           calibrated: bool = False) -> dict[str, float]:
    now = [0.0]
    with mock.patch.object(time, "monotonic", lambda: now[0]):
        rnd = random.Random(seed)
        costs = StepCost(max_batched_tokens=MAX_BATCHED_TOKENS)
        for shape in (StepShape(1), StepShape(8), StepShape(16, adapters=2), StepShape(0, 100, 1),
                      StepShape(0, 50, 1), StepShape(0, 100, 2), StepShape(4, 32, 1, 1), StepShape(8, 64, 2, 3)):
            costs.observe_prior(shape, device_s(shape))
        cache = AdapterCache({}, max_loras=4, max_cpu_loras=4)
        for name in FLOWS[1:]:
            cache.insert(LoraAdapter(name, name * 64, 8, (), 0))
        scheduler = Scheduler(SchedulerLimits(MAX_NUM_SEQS, MAX_BATCHED_TOKENS), BlockManager(4096, 16), cache,
                              lambda adapter: True, prefill_budget=costs.prefill_budget, step_time=costs.predict)
        # the engine's own estimate, over these parts (it reads nothing else of the engine)
        engine = SimpleNamespace(scheduler=scheduler, delays=DelayEstimator(costs),
                                 limits=SimpleNamespace(max_queue_delay_s=max_queue_delay_s))
        admitted: list[Sequence] = []
        first_token: dict[str, float] = {}
        refused, arrival = 0, 0.0
        while now[0] < seconds or scheduler.running or scheduler.waiting:
            while now[0] < seconds and arrival <= now[0]:
                adapter, prompt, new = rnd.choice(FLOWS), rnd.randint(10, 140), rnd.randint(16, 48)
                load = scheduler.load()
                calibration = engine.delays.calibration(account_of(adapter, None))
                # as Engine._admit judges: the tail of recent lateness, and a step kept before the promise ends
                tail = calibration.tail() if calibrated else 1.0
                keep_s = costs.step_target(load.running_decodes, load.adapters) \
                    if calibrated and load.running_decodes else 0.0
                wait_s, own_s = Engine._estimate_first_token(engine, adapter, None, prompt, load, None, tail)
                if lateness(wait_s, own_s, tail, max_queue_delay_s, None, keep_s) is not None:
                    refused += 1
                    scheduler.turned_away(adapter)
                else:
                    seq = Sequence(f"r{len(admitted)}", adapter, list(range(prompt)),
                                   SamplingParams(max_tokens=new), prompt + new, arrival=now[0],
                                   timing=Timing(ttft_estimate=wait_s, ttft_bias=calibration.bias,
                                                 first_token_due=now[0] + promise_s(own_s * tail, max_queue_delay_s)))
                    scheduler.add(seq)
                    admitted.append(seq)
                arrival += rnd.expovariate(rate)
            if not (scheduler.running or scheduler.waiting):
                now[0] = arrival
                continue
            batch = scheduler.schedule()
            shape = step_shape(batch)
            engine.delays.step_began(shape)
            now[0] += device_s(shape)
            engine.delays.observe_step(shape, device_s(shape))
            sampled = [item.samples for item in batch]
            scheduler.postprocess(batch, [0 if sample else None for sample in sampled])
            for item, sample in zip(batch, sampled, strict=True):
                if sample:
                    seq = item.seq
                    if seq.request_id not in first_token and calibrated:  # the pod's correction learns from it
                        engine.delays.observe_first_token(seq.timing.ttft_estimate, now[0] - seq.arrival,
                                                          account_of(seq.adapter, None), seq.timing.ttft_bias)
                    first_token.setdefault(item.seq.request_id, now[0])
                    if item.seq.num_tokens >= item.seq.max_total:
                        scheduler.finish(item.seq)
    ttft = sorted(first_token[seq.request_id] - seq.arrival for seq in admitted)
    late = sorted((first_token[seq.request_id] - seq.arrival) / max(seq.timing.ttft_estimate, 1e-3)
                  for seq in admitted)

    # requests over twice late (estimates of 50 ms or more), and how many later arrivals started before their first
    # token though they had started first: the estimate lets nobody overtake a started prompt
    slow = [seq for seq in admitted
            if first_token[seq.request_id] - seq.arrival > 2 * max(seq.timing.ttft_estimate, 0.05)]
    overtaken = [sum(1 for other in admitted if seq.timing.first_scheduled < other.arrival
                     and other.timing.first_scheduled < first_token[seq.request_id]) for seq in slow]

    def quantile(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))]

    kept = sum(1 for seq in admitted if first_token[seq.request_id] <= seq.timing.first_token_due)
    return {"requests": len(admitted) + refused, "refused": refused, "kept": kept, "ttft_p50": quantile(ttft, 0.5),
            "ttft_p99": quantile(ttft, 0.99), "ttft_max": ttft[-1], "late_p50": quantile(late, 0.5),
            "late_p90": quantile(late, 0.9), "late_p99": quantile(late, 0.99), "slow": len(slow),
            "overtaken": sum(overtaken) / max(1, len(slow))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=float, nargs="+", default=[1.5, 3.5, 7.0],
                        help="arrival rates to replay, requests a second (default: 1.5 3.5 7)")
    parser.add_argument("--seconds", type=float, default=120.0, help="virtual seconds of arrivals (default: 120)")
    parser.add_argument("--seed", type=int, default=1, help="the load's random seed (default: 1)")
    parser.add_argument("--max-queue-delay", type=float, default=1.5,
                        help="the promise admission keeps, seconds (default: 1.5, the pod's)")
    parser.add_argument("--calibrated", action="store_true",
                        help="correct estimates and judge them by their tail as the pod does (default: the plan "
                             "alone)")
    args = parser.parse_args()
    print("rate/s  requests  refused  kept  TTFT p50/p99/max s    first token / estimate p50/p90/p99  over 2x  "
          "overtaken")
    for rate in args.rates:
        r = replay(rate, args.seconds, args.seed, args.max_queue_delay, args.calibrated)
        print(f"{rate:6.1f}  {r['requests']:8d}  {r['refused']:7d}  {r['kept']:4d}  {r['ttft_p50']:.2f} / "
              f"{r['ttft_p99']:.2f} / {r['ttft_max']:.2f}      {r['late_p50']:.2f} / {r['late_p90']:.2f} / "
              f"{r['late_p99']:.2f}  {r['slow']:7d}  {r['overtaken']:9.1f}")


if __name__ == "__main__":
    main()
