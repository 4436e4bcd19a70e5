"""transformers + peft on benchmarks/gpu.py's checkpoint: the reference that our pod's log-probabilities
are checked against, and the mixed-adapter batch (``generate(..., adapter_names=[...])``) that our
serving throughput is compared with."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from data_plane.engine.sequence import TokenOut

BASE_ROW = "__base__"  # peft's name for a row of a mixed batch that runs without an adapter


class Reference:
    """The checkpoint in transformers on ``device`` in ``dtype``, with every adapter ``root/<name>`` of
    ``names`` loaded into one peft model."""

    def __init__(self, model_dir: Path, root: Path, names: list[str], device: str, dtype: torch.dtype) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        self.device = device
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map=device).eval()
        self.config = base.config
        # Adapters stay in the checkpoint's dtype, as the pod keeps them (peft would upcast them to float32).
        self.model = PeftModel.from_pretrained(base, root / names[0], adapter_name=names[0],
                                               autocast_adapter_dtype=False)
        for name in names[1:]:
            self.model.load_adapter(root / name, adapter_name=name, low_cpu_mem_usage=True,
                                    autocast_adapter_dtype=False)
        self.model.eval()

    def logprobs(self, adapter: str | None, ids: list[int]) -> torch.Tensor:
        """Log-probabilities of the next token at every position of ``ids`` ([len(ids), vocab] float32,
        on the host) with ``adapter`` active (None: none)."""
        with torch.inference_mode():
            x = torch.tensor([ids], device=self.device)
            if adapter is None:
                with self.model.disable_adapter():
                    logits = self.model(x).logits[0].float().cpu()
            else:
                self.model.set_adapter(adapter)
                logits = self.model(x).logits[0].float().cpu()
        return torch.log_softmax(logits, dim=-1)

    def generate(self, requests: list[tuple[list[int], str | None]], new_tokens: int, pad_id: int) -> float:
        """Seconds of one greedy ``generate`` over all ``requests`` as one left-padded batch, each row
        with its own adapter, exactly ``new_tokens`` new tokens per row (after an untimed small one)."""
        width = max(len(ids) for ids, _ in requests)
        input_ids = torch.full((len(requests), width), pad_id, dtype=torch.long)  # [rows, width]
        mask = torch.zeros_like(input_ids)  # [rows, width], 1 on prompt tokens
        for i, (ids, _) in enumerate(requests):
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            mask[i, width - len(ids):] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        names = [adapter or BASE_ROW for _, adapter in requests]

        def generate(rows: int, tokens: int) -> torch.Tensor:
            with torch.inference_mode():
                return self.model.generate(input_ids=input_ids[:rows], attention_mask=mask[:rows],
                                           adapter_names=names[:rows], max_new_tokens=tokens, min_new_tokens=tokens,
                                           do_sample=False, pad_token_id=pad_id)

        generate(2, 2)
        self._sync()
        started = time.perf_counter()
        out = generate(len(requests), new_tokens)
        self._sync()
        wall = time.perf_counter() - started
        if out.shape[1] - width != new_tokens:
            raise RuntimeError(f"peft generated {out.shape[1] - width} tokens per row, asked for {new_tokens}")
        return wall

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


FLOAT32_ATOL = 2e-3  # |Δ log-probability| allowed to a float32 pod against transformers + peft in float32
ROUNDING_FACTOR = 3  # a pod in bfloat16/float16 may land this many times farther from float32 than transformers


@dataclass(frozen=True)
class Reading:
    """A reference's log-probabilities on one parity row, teacher-forced on the pod's tokens: of each
    token the pod returned and of its alternatives ([new tokens, 1 + top], in the pod's order), of the
    reference's own most likely token at each position ([new tokens]), and, for an adapter, of the
    first ones without it ([new tokens, 1 + top]; None for the base model)."""
    got: torch.Tensor
    best: torch.Tensor
    base: torch.Tensor | None


def read(reference: Reference, adapter: str | None, prompt: list[int], outputs: list[TokenOut]) -> Reading:
    """``reference``'s reading of our pod's ``outputs`` for ``prompt`` (greedy, with top log-probabilities)."""
    if not outputs or any(not t.top for t in outputs):
        raise RuntimeError(f"the pod returned no top log-probabilities for a parity row ({len(outputs)} tokens)")
    ids = prompt + [t.id for t in outputs[:-1]]
    first = len(prompt) - 1  # the position that predicts the first generated token
    index = torch.tensor([[t.id, *(i for i, _ in t.top)] for t in outputs])  # [new tokens, 1 + top]
    expected = reference.logprobs(adapter, ids)[first:]  # [new tokens, vocab]
    base = None if adapter is None else reference.logprobs(None, ids)[first:].gather(1, index)
    return Reading(expected.gather(1, index), expected.max(dim=1).values, base)


def parity_row(adapter: str | None, outputs: list[TokenOut], truth: Reading, rounded: Reading | None = None) -> dict:
    """Our pod's greedy tokens, their log-probabilities and the top alternatives' (``outputs``) against
    transformers (+ peft) in float32 (``truth``). The tolerance: ``FLOAT32_ATOL`` for a pod in float32;
    for one in bfloat16 or float16, ``ROUNDING_FACTOR`` times the farthest that transformers (+ peft) in
    that dtype (``rounded``, read on the same tokens) land from float32, what rounding to the dtype costs
    an implementation nobody here wrote, and never under ``FLOAT32_ATOL``. Passes when every
    log-probability is within it, every chosen token is within it of float32's most likely one, and, for
    an adapter, the adapter moves float32's log-probabilities of those tokens by more than twice it, so
    that a pod that ignored the adapter or applied it at half strength fails."""
    ours = torch.tensor([[t.logprob, *(lp for _, lp in t.top)] for t in outputs])
    rounding = None if rounded is None else (rounded.got - truth.got).abs().max().item()
    atol = FLOAT32_ATOL if rounding is None else max(FLOAT32_ATOL, ROUNDING_FACTOR * rounding)
    diff = (truth.got - ours).abs().max().item()
    greedy_gap = (truth.best - truth.got[:, 0]).max().item()
    effect = math.inf if truth.base is None else (truth.base - truth.got).abs().max().item()
    ok = diff <= atol and greedy_gap <= atol and effect > 2 * atol
    return {"adapter": adapter or "base", "tokens": len(outputs), "max_diff": diff, "atol": atol,
            "reference_rounding": rounding, "greedy_gap": greedy_gap,
            "adapter_effect": None if truth.base is None else effect, "ok": ok}
