"""transformers + peft on benchmarks/gpu.py's checkpoint: the reference that our pod's log-probabilities
are checked against, and the mixed-adapter batch (``generate(..., adapter_names=[...])``) that our
serving throughput is compared with."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from data_plane.engine.sequence import TokenOut
from tests.tolerances import LOGITS_K, eps, logits_atol, longest_sum, magnitude

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

    def logprobs(self, adapter: str | None, ids: list[int]) -> tuple[torch.Tensor, float]:
        """Log-probabilities of the next token at every position of ``ids`` ([len(ids), vocab] float32,
        on the host) with ``adapter`` active (None: none), and the largest |logit|."""
        with torch.inference_mode():
            x = torch.tensor([ids], device=self.device)
            if adapter is None:
                with self.model.disable_adapter():
                    logits = self.model(x).logits[0].float().cpu()
            else:
                self.model.set_adapter(adapter)
                logits = self.model(x).logits[0].float().cpu()
        return torch.log_softmax(logits, dim=-1), magnitude(logits)

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


def logprob_atol(config, dtype: torch.dtype, scale: float, rank: int, tokens: int) -> float:
    """The largest |Δ log-probability| allowed between our pod and transformers on one row of
    ``tokens`` tokens with a rank-``rank`` adapter (0: none), ``scale`` the largest |logit|: twice
    ``tests.tolerances.logits_atol`` (float32 sums). In bfloat16/float16 each layer also rounds its
    outputs to that dtype (operands in it, sums in float32), once per chained sum instead of per term;
    those roundings (relative eps/2 each) add across the layers in the residual stream like a random
    walk, so LOGITS_K·eps/2·sqrt(layers)·scale on top (the √layers growth is what random Llama models
    of 2 and 6 layers show in bfloat16 against float32)."""
    atol = logits_atol(longest_sum(config, rank=rank, tokens=tokens), scale)
    if dtype != torch.float32:
        atol += LOGITS_K * eps(dtype) / 2 * math.sqrt(config.num_hidden_layers) * scale
    return 2 * atol


def parity_row(reference: Reference, dtype: torch.dtype, adapter: str | None, rank: int, prompt: list[int],
               outputs: list[TokenOut]) -> dict:
    """Our pod's greedy tokens, their log-probabilities and the top alternatives' against transformers
    (+ peft) teacher-forced on the same tokens. Passes when every log-probability is within
    ``logprob_atol``, every chosen token is within it of the reference's most likely one, and, for an
    adapter, the adapter moves the reference's log-probabilities of those tokens by more than it (so
    that a pod that ignored the adapter would fail)."""
    if not outputs or any(not t.top for t in outputs):
        raise RuntimeError(f"the pod returned no top log-probabilities for a parity row ({len(outputs)} tokens)")
    ids = prompt + [t.id for t in outputs[:-1]]
    first = len(prompt) - 1  # the position that predicts the first generated token
    expected, scale = reference.logprobs(adapter, ids)
    expected = expected[first:]  # [new tokens, vocab]
    index = torch.tensor([[t.id, *(i for i, _ in t.top)] for t in outputs])  # [new tokens, 1 + top]
    ours = torch.tensor([[t.logprob, *(lp for _, lp in t.top)] for t in outputs])
    got = expected.gather(1, index)
    diff = (got - ours).abs().max().item()
    greedy_gap = (expected.max(dim=1).values - got[:, 0]).max().item()
    atol = logprob_atol(reference.config, dtype, scale, rank, len(ids))
    effect = math.inf
    if adapter is not None:
        base, _ = reference.logprobs(None, ids)
        effect = (base[first:].gather(1, index) - got).abs().max().item()
    ok = diff < atol and greedy_gap <= atol and effect > atol
    return {"adapter": adapter or "base", "rank": rank, "tokens": len(outputs), "max_diff": diff, "atol": atol,
            "greedy_gap": greedy_gap, "adapter_effect": None if adapter is None else effect, "ok": ok}
