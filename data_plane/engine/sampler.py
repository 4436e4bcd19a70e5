"""Choosing the next token of every sampling row of a step at once, on the logits' device.

Contract:

- ``SamplingBatch.build(seqs, device)``, once per step, reads each sequence's parameters and the
  position of the token it samples, and makes the per-row tensors with at most one host->device copy
  (none when every row is greedy). Its host facts (which rows draw, their top-k values, how many use
  top-p, how many logprobs each row wants) are all that ``sample`` branches on.
- ``sample(logits, batch, masks)`` takes ``logits`` [rows, vocab] float32 on any device and returns a
  ``Sampled`` of device tensors. Each row's ``logit_bias`` is added to its logits first, then the
  row's grammar mask (``masks`` [rows, ceil(vocab / 32)] int32, bit ``j % 32`` of word ``j // 32`` set
  when token ``j`` may come next; see grammar.py) sets every token it forbids to ``-inf``; the choice
  below is made on what results. It never synchronises with the host: no ``.item()``, ``.tolist()``,
  ``.cpu()``, ``nonzero`` or shape that depends on values. Greedy rows (temperature 0) take the
  argmax (the lowest id among equal logits). The others divide by their temperature; keep their
  top-k logits (0 or k >= vocab: all; ties with the k-th kept); then keep the smallest prefix of the
  distribution sorted by probability (ties: lower id first) whose mass reaches top_p, the token that
  crosses it included (0 or 1: all; mass counted exactly in units of 2**-40); and draw from what is
  left. Logprobs are always of the model's own distribution, ``log_softmax(logits)``: the chosen
  token's, and each row's top-n alternatives (most likely first, equal logits in id order), before any
  bias or mask.
- ``Sampled.to_host()`` is the step's one device->host copy; it gives the engine's ``TokenOut`` list.
  ``Sampled.copy_to_host()`` starts that copy without waiting for it (``HostTokens``): the engine's
  asynchronous loop launches the next step, whose input ids are these ``ids`` on the device, before it
  reads them.

Draws are counter-based, so a request's tokens do not depend on what shares its step, on which row it
runs, or on a recomputation after preemption. The draw for the token at position ``counter`` (the
sequence's ``num_tokens`` when it samples) of a request with 64-bit ``seed`` uses, for vocabulary id
``j``, the uniform ``u_j = hash(seed, counter, j)``: 32-bit xor-shift-multiply mixing in int64 tensor
ops (a 32-bit value times a multiplier below 2**31 stays below 2**63), the same bits on every device.
The chosen id is ``argmax_j(scaled_j + g_j)`` over the kept ids, with ``g_j = -log(-log u_j)``
(Gumbel-max). Why this is exact: the ``g_j`` are independent standard Gumbels, so ``scaled_j + g_j``
is Gumbel with location ``scaled_j``, and the largest of independent Gumbels with locations ``l_j``
falls on ``j`` with probability ``exp(l_j) / sum_i exp(l_i)``. (Equivalently: ``exp(-g_j)`` are
independent Exp(1), and the argmax is the first of exponential clocks with rates ``p_j`` to ring.)
Masked ids hold ``-inf`` and never win, so the draw follows softmax(logits / temperature) renormalised
over the kept ids: exactly the distribution top-k and top-p define, up to the 2**-24 grid of the
uniforms and the hash standing in for independent draws.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import repeat

import torch

from data_plane.engine.grammar import GrammarState
from data_plane.engine.sequence import Sequence, TokenOut
from data_plane.engine.step_inputs import host_ints

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31, chosen for avalanche (each input bit flips each output bit with
# probability 1/2 within sampling noise, measured over random inputs).
_MUL1, _MUL2 = 0x7FEB352D, 0x68E31DA5
_SPREAD = 0x9E3779B9  # spreads consecutive vocabulary ids over 32 bits (id < 2**31: product < 2**63)
_UNIFORM_BITS = 24  # what float32 holds exactly: u = (h >> 8 + 1/2) / 2**24 lies strictly inside (0, 1)
# Temperatures are floored: a far smaller one could overflow float32 (logits / 1e-40), and at 1e-5 a
# draw is already the argmax unless two logits lie within about 1e-4 of each other.
_MIN_TEMPERATURE = 1e-5
_MASS_BITS = 40  # top-p counts mass in units of 2**-40: a vocabulary's sum stays far below 2**63

# Rows of the packed per-row host tensor, one host->device copy. Floats travel as float64 bit patterns.
# The top-p rows come first in their two rows, padded to the number of drawing rows. The logit biases
# follow in three rows of their own length: logits row, token id, bias.
_ROW, _TOP_K, _SEED, _COUNTER, _TOP_P_ROW, _TEMPERATURE, _TOP_P = range(7)
_DRAW_FIELDS, _BIAS_FIELDS = 7, 3
# A sequence's fixed sampling fields as a persistent batch keeps them (``row_fields``), int64 each; the
# floats as float64 bit patterns.
_F_GREEDY, _F_TOP_K, _F_SEED, _F_TEMPERATURE, _F_TOP_P, _F_USES_TOP_P, _F_LOGPROBS = range(7)
ROW_FIELDS = 7
_ONE_BITS = struct.unpack("<q", struct.pack("<d", 1.0))[0]  # 1.0 as float64 bits: a row without top-p


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling inputs of one step. Device tensors cover only the rows that draw
    (``draw_rows``), or of those only the ones that use top-p; host facts cost no synchronisation."""

    num_rows: int
    num_logprobs: tuple[int, ...]  # [rows] top alternatives each row asked for
    top_ks: tuple[int, ...]  # [draws] each drawing row's top_k (0 = off), to size the top-k on the host
    num_top_p: int  # drawing rows with 0 < top_p < 1
    draw_rows: torch.Tensor  # [draws] int64: logits row of each non-greedy row, ascending
    temperature: torch.Tensor  # [draws] float32, > 0
    top_k: torch.Tensor  # [draws] int64, 0 = off
    top_p_rows: torch.Tensor  # [num_top_p] int64: index among the drawing rows of each that uses top-p
    top_p: torch.Tensor  # [num_top_p] float64, within (0, 1)
    seed: torch.Tensor  # [draws] int64: the request's 64-bit seed in two's complement
    counter: torch.Tensor  # [draws] int64: position of the token being sampled
    bias_rows: torch.Tensor  # [biases] int64: logits row of each (row, token) bias
    bias_ids: torch.Tensor  # [biases] int64
    bias_values: torch.Tensor  # [biases] float32
    grammar_rows: tuple[tuple[GrammarState, int], ...] = ()  # each constrained row's matcher and logits row
    draw_index: torch.Tensor | None = None  # [draws] int64 on the host: draw_rows, where gather made the batch

    @property
    def num_biases(self) -> int:
        return self.bias_rows.shape[0]

    @property
    def num_draws(self) -> int:
        return len(self.top_ks)

    @property
    def max_logprobs(self) -> int:
        return max(self.num_logprobs, default=0)

    @classmethod
    def build(cls, seqs: list[Sequence], device: torch.device | str) -> SamplingBatch:
        """The batch for ``seqs``, one per logits row in that order, each about to sample the token
        at position ``seq.num_tokens``."""
        draws = [(i, s) for i, s in enumerate(seqs) if not s.params.greedy]
        top_p = [(j, s.params.top_p) for j, (_, s) in enumerate(draws) if 0.0 < s.params.top_p < 1.0]
        pad = [(0, 1.0)] * (len(draws) - len(top_p))
        ints = [[i, s.params.top_k, _signed64(s.sampling_seed), s.num_tokens, j]
                for (i, s), (j, _) in zip(draws, top_p + pad, strict=True)]
        floats = [[max(s.params.temperature, _MIN_TEMPERATURE), p]
                  for (_, s), (_, p) in zip(draws, top_p + pad, strict=True)]

        def fill(draw_host: torch.Tensor) -> None:
            draw_host[:_TEMPERATURE] = torch.tensor(ints, dtype=torch.int64).T
            draw_host[_TEMPERATURE:].view(torch.float64).copy_(torch.tensor(floats, dtype=torch.float64).T)

        return cls._pack(
            fill, len(draws), [(i, t, b) for i, s in enumerate(seqs) for t, b in s.params.logit_bias], device,
            num_rows=len(seqs), num_logprobs=tuple(s.params.logprobs for s in seqs),
            top_ks=tuple(s.params.top_k for _, s in draws), num_top_p=len(top_p),
            grammar_rows=tuple((s.grammar, i) for i, s in enumerate(seqs) if s.grammar is not None))

    @classmethod
    def gather(cls, fields: torch.Tensor, rows: list[int], counters: list[int],
               biases: list[tuple[int, int, float]], grammar_rows: tuple[tuple[GrammarState, int], ...],
               device: torch.device | str) -> SamplingBatch:
        """What ``build`` gives for the sequences whose ``row_fields`` are at ``rows`` of ``fields``
        [rows, ROW_FIELDS] (a persistent batch's, on the host), one per logits row in that order, each
        sampling the token at position ``counters[i]``, with ``biases`` (logits row, token id, bias) and
        ``grammar_rows`` (matcher, logits row) in logits-row order: tensor gathers on the host and the same
        one host->device copy, instead of a walk over each sequence's parameters."""
        per_row = fields[host_ints(rows)]  # [rows, ROW_FIELDS]
        draw_rows = (per_row[:, _F_GREEDY] == 0).nonzero()[:, 0]  # [draws]: host tensors, no device wait
        draws = per_row[draw_rows]  # [draws, ROW_FIELDS]
        top_p_rows = draws[:, _F_USES_TOP_P].nonzero()[:, 0]  # [num_top_p]
        num_top_p = top_p_rows.shape[0]

        def fill(draw_host: torch.Tensor) -> None:
            draw_host[_ROW] = draw_rows
            draw_host[_TOP_K] = draws[:, _F_TOP_K]
            draw_host[_SEED] = draws[:, _F_SEED]
            draw_host[_COUNTER] = host_ints(counters)[draw_rows]
            draw_host[_TOP_P_ROW].zero_()[:num_top_p] = top_p_rows
            draw_host[_TEMPERATURE] = draws[:, _F_TEMPERATURE]
            draw_host[_TOP_P].fill_(_ONE_BITS)[:num_top_p] = draws[top_p_rows, _F_TOP_P]

        return cls._pack(fill, draws.shape[0], biases, device, num_rows=len(rows),
                         num_logprobs=tuple(per_row[:, _F_LOGPROBS].tolist()),
                         top_ks=tuple(draws[:, _F_TOP_K].tolist()), num_top_p=num_top_p, grammar_rows=grammar_rows,
                         draw_index=draw_rows)

    def recounted(self, counters: list[int]) -> SamplingBatch:
        """The batch of ``gather``'s same rows, each now sampling the token at position ``counters[i]``: only
        the drawing rows' counters are sent, in one copy (none when every row is greedy). A persistent
        batch's next decode step over the same sequences samples with it."""
        if not self.num_draws:
            return self
        host = host_ints(counters)[self.draw_index]
        device = self.counter.device
        if device.type == "cuda":  # pinned, so that the copy need not wait for the host
            host = host.pin_memory()
        return replace(self, counter=host.to(device, non_blocking=True))

    @classmethod
    def _pack(cls, fill: Callable[[torch.Tensor], None], num_draws: int, biases: list[tuple[int, int, float]],
              device: torch.device | str, **host_facts) -> SamplingBatch:
        """The batch whose drawing rows ``fill`` writes into a [_DRAW_FIELDS, num_draws] int64 host view and
        whose ``biases`` are (logits row, token id, bias), sent to ``device`` in one copy (none when nothing
        draws or is biased), the device fields views of it; ``host_facts``: the fields kept on the host."""
        device = torch.device(device)
        d, nb = num_draws, len(biases)
        if d or nb:  # one copy, then views; pinned on CUDA so the copy need not wait for the host
            host = torch.empty(_DRAW_FIELDS * d + _BIAS_FIELDS * nb, dtype=torch.int64,
                               pin_memory=device.type == "cuda")
            draw_host, bias_host = host[: _DRAW_FIELDS * d].view(_DRAW_FIELDS, d), host[_DRAW_FIELDS * d:].view(3, nb)
            if d:
                fill(draw_host)
            if biases:
                bias_host[:2] = torch.tensor([b[:2] for b in biases], dtype=torch.int64).T
                bias_host[2].view(torch.float64).copy_(torch.tensor([b[2] for b in biases], dtype=torch.float64))
            flat = host.to(device, non_blocking=True)
        else:  # every row greedy, no biases: nothing to copy
            flat = torch.empty(0, dtype=torch.int64, device=device)
        packed = flat[: _DRAW_FIELDS * d].view(_DRAW_FIELDS, d)
        bias = flat[_DRAW_FIELDS * d:].view(_BIAS_FIELDS, nb)
        floats_dev = packed[_TEMPERATURE:].view(torch.float64)  # [2, draws]
        num_top_p = host_facts["num_top_p"]
        return cls(
            draw_rows=packed[_ROW],
            temperature=floats_dev[0].float(),
            top_k=packed[_TOP_K],
            top_p_rows=packed[_TOP_P_ROW, :num_top_p],
            top_p=floats_dev[1, :num_top_p],
            seed=packed[_SEED],
            counter=packed[_COUNTER],
            bias_rows=bias[0],
            bias_ids=bias[1],
            bias_values=bias[2].view(torch.float64).float(),
            **host_facts,
        )


def row_fields(seq: Sequence) -> list[int]:
    """``seq``'s sampling parameters as a persistent batch's row keeps them ([ROW_FIELDS] int64, the floats
    as float64 bit patterns): fixed while it runs, so written once."""
    p = seq.params
    uses_top_p = 0.0 < p.top_p < 1.0
    return [int(p.greedy), p.top_k, _signed64(seq.sampling_seed), _float_bits(max(p.temperature, _MIN_TEMPERATURE)),
            _float_bits(p.top_p) if uses_top_p else _ONE_BITS, int(uses_top_p), p.logprobs]


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


@dataclass(frozen=True)
class Sampled:
    """One step's choices, on the logits' device until ``to_host``."""

    ids: torch.Tensor  # [rows] int64
    logprobs: torch.Tensor  # [rows] float32: log_softmax(logits) of the chosen id
    top_ids: torch.Tensor  # [rows, max_logprobs] int64, most likely first
    top_logprobs: torch.Tensor  # [rows, max_logprobs] float32
    num_logprobs: tuple[int, ...]  # [rows] how many of the top alternatives each row returns

    def to_host(self) -> list[TokenOut]:
        """The tokens, one per row, after one device->host copy (float64 holds the ids exactly)."""
        return self.copy_to_host().tokens()

    def copy_to_host(self) -> HostTokens:
        """Starts the step's one device->host copy of the tokens and returns at once: on CUDA a non-blocking
        copy into pinned memory that ``HostTokens.tokens`` waits for, so the host may launch the next step
        meanwhile; on the CPU the tensors are the host's already."""
        columns = [self.ids[:, None].double(), self.logprobs[:, None].double()]
        if self.top_ids.shape[1]:
            columns += [self.top_ids.double(), self.top_logprobs.double()]
        packed = torch.cat(columns, dim=1)  # [rows, 2 + 2n]
        if packed.device.type != "cuda":
            return HostTokens(packed, self.num_logprobs, None)
        host = torch.empty(packed.shape, dtype=torch.float64, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return HostTokens(host, self.num_logprobs, copied)


@dataclass(frozen=True)
class HostTokens:
    """A step's tokens on their way to the host: [rows, 2 + 2n] float64 (id, logprob, n top ids, n top
    logprobs), readable once ``copied`` (None: at once) has run."""

    packed: torch.Tensor
    num_logprobs: tuple[int, ...]  # [rows] how many of the top alternatives each row returns
    copied: torch.cuda.Event | None

    def ready(self) -> bool:
        """Whether ``tokens`` would return without waiting for the device."""
        return self.copied is None or self.copied.query()

    def tokens(self) -> list[TokenOut]:
        """The tokens, one per row, once the copy has run (waiting for it if need be)."""
        if self.copied is not None:
            self.copied.synchronize()
        n = (self.packed.shape[1] - 2) // 2
        if n == 0:  # no row asked for alternatives: one tuple a token, made without a call per token
            ids, logprobs = self.packed[:, 0].long().tolist(), self.packed[:, 1].tolist()
            return [_tuple(TokenOut, token) for token in zip(ids, logprobs, repeat(()))]
        out = []
        for row, k in zip(self.packed.tolist(), self.num_logprobs, strict=True):
            top = tuple((int(row[2 + j]), row[2 + n + j]) for j in range(k))
            out.append(TokenOut(int(row[0]), row[1], top))
        return out


_tuple = tuple.__new__  # TokenOut is a NamedTuple: tuple.__new__(TokenOut, fields) makes one


def sample(logits: torch.Tensor, batch: SamplingBatch, masks: torch.Tensor | None = None) -> Sampled:
    """The next token of each row of ``logits`` [rows, vocab] float32 under ``batch``'s parameters and the
    grammar ``masks`` [rows, ceil(vocab / 32)] int32 (None: none), as the module's contract says, with no
    host synchronisation."""
    rows, vocab = logits.shape
    if rows != batch.num_rows:
        raise ValueError(f"logits have {rows} rows but the sampling batch was built for {batch.num_rows}")
    if logits.dtype != torch.float32:
        raise TypeError(f"sample takes float32 logits, got {logits.dtype}: convert with .float() first")
    choice = logits  # what the choice is made on: the logits, biased and masked where asked
    if batch.num_biases or masks is not None:
        choice = logits.clone()
        if batch.num_biases:  # one (row, id) pair per bias: no two writes land on one element
            choice.index_put_((batch.bias_rows, batch.bias_ids), batch.bias_values, accumulate=True)
        if masks is not None:
            choice.masked_fill_(_allowed(masks, vocab).logical_not_(), float("-inf"))
    ids = choice.argmax(dim=-1, keepdim=True)  # [rows, 1]: greedy's choice, ties to the lowest id
    if 0 < batch.num_draws == rows:  # draw_rows is every row, in order
        ids = _draw(choice, batch, vocab)[:, None]
    elif batch.num_draws:
        drawn = _draw(choice.index_select(0, batch.draw_rows), batch, vocab)[:, None]  # [draws, 1]
        ids = ids.index_copy_(0, batch.draw_rows, drawn)
    # The whole row's log_softmax: its kernel sums each row alone, the same way whatever the number of rows,
    # where a plain sum over the vocabulary splits a lone row across threads (another order, other bits).
    logprobs = torch.log_softmax(logits, dim=-1)  # [rows, vocab]
    chosen = logprobs.gather(1, ids)[:, 0]  # [rows]
    top_ids = _top_ids(logits, min(batch.max_logprobs, vocab))  # [rows, max_logprobs]
    return Sampled(ids[:, 0], chosen, top_ids, logprobs.gather(1, top_ids), batch.num_logprobs)


def _top_ids(logits: torch.Tensor, n: int) -> torch.Tensor:
    """[rows, n] the ids of each row's ``n`` largest ``logits`` [rows, vocab] float32, largest first, equal
    logits in id order. A plain topk breaks ties (common in bfloat16 logits) in an order that depends on how
    many rows share the call; here each id's key is its logit's bits, made monotonic as an integer, above
    its reversed id, so no two keys are equal."""
    if n == 0:
        return torch.empty(logits.shape[0], 0, dtype=torch.int64, device=logits.device)
    vocab = logits.shape[1]
    bits = (logits + 0.0).view(torch.int32).long()  # [rows, vocab]; + 0.0 makes -0.0 the +0.0 it equals
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # a negative float's magnitude bits reversed: monotonic
    keys = (bits << 32) | (vocab - 1 - torch.arange(vocab, device=logits.device))  # [rows, vocab]
    return (vocab - 1) - (keys.topk(n, dim=-1).values & _MASK32)


def _allowed(masks: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] bool from the packed ``masks`` [rows, words] int32: bit ``j % 32`` of word ``j // 32``."""
    shifts = torch.arange(32, dtype=torch.int32, device=masks.device)  # [32]
    bits = masks[:, :, None].bitwise_right_shift(shifts).bitwise_and_(1)  # [rows, words, 32]
    return bits.view(masks.shape[0], -1)[:, :vocab].bool()


def _draw(logits: torch.Tensor, batch: SamplingBatch, vocab: int) -> torch.Tensor:
    """[draws] ids drawn from ``logits`` [draws, vocab] (the drawing rows) after temperature, top-k, top-p."""
    scaled = logits / batch.temperature[:, None]  # [draws, vocab]
    k_max = max((k for k in batch.top_ks if 0 < k < vocab), default=0)
    if k_max:
        on = (batch.top_k > 0) & (batch.top_k < vocab)  # [draws]
        kth = scaled.topk(k_max, dim=-1).values.gather(1, (batch.top_k.clamp(1, k_max) - 1)[:, None])
        kth = kth.masked_fill(~on[:, None], float("-inf"))  # [draws, 1]: off rows keep everything
        scaled.masked_fill_(scaled < kth, float("-inf"))
    if batch.num_top_p:
        nucleus = scaled.index_select(0, batch.top_p_rows)  # [num_top_p, vocab]
        keep = _nucleus(nucleus.softmax(dim=-1), batch.top_p)
        scaled.index_copy_(0, batch.top_p_rows, nucleus.masked_fill_(~keep, float("-inf")))
    return scaled.add_(_gumbel(batch.seed, batch.counter, vocab)).max(dim=-1).indices


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] bool: the smallest prefix of each row of ``probs`` [rows, vocab], ordered by
    probability (ties: lower id first), whose mass reaches the row's ``top_p`` [rows], the crossing
    token included.

    Without a sort (a CPU sorts a vocabulary in milliseconds a row): a radix select finds the crossing
    token's float32 bit pattern (monotonic in p >= 0, and below 2**30 for p <= 1) ten bits at a time,
    from per-row histograms of mass over the next ten bits. Masses are counted in int64 units of
    2**-40 (each token's rounded once), so every sum is exact, in any order, on any device: the cut
    depends neither on summation order nor on the batch. Large temporaries are reused in place, as a
    CPU spends more on fresh [rows, vocab] tensors than on the arithmetic.
    """
    rows = probs.shape[0]
    bits = probs.view(torch.int32).long()  # [rows, vocab]
    mass = (probs * 2.0**_MASS_BITS).round_().long()  # [rows, vocab]: exact, float32 scaled by a power of 2
    target = (top_p * 2.0**_MASS_BITS).round_().long().clamp_(min=1)[:, None]  # [rows, 1]: the top token always
    prefix = torch.zeros(rows, 1, dtype=torch.int64, device=probs.device)  # crossing token's bits found so far
    bucket = torch.empty_like(bits)  # [rows, vocab]
    for shift in (20, 10, 0):
        # Buckets: 0 = ranked below the tokens that share the prefix, 1..1024 = those by their next ten
        # bits, 1025 = ranked above them.
        below = ((prefix >> (shift + 10)) << 10) - 1  # [rows, 1]
        torch.bitwise_right_shift(bits, shift, out=bucket).sub_(below).clamp_(0, 1025)
        hist = torch.zeros(rows, 1026, dtype=torch.int64, device=probs.device).scatter_add_(1, bucket, mass)
        before = hist.flip(-1).cumsum(-1).flip(-1) - hist  # [rows, 1026]: mass ranked above each bucket
        # the crossing bucket: the lowest whose tokens still start before the target mass
        crossing = ((before < target) & (hist > 0)).byte().argmax(dim=-1, keepdim=True)  # [rows, 1]
        prefix |= (crossing - 1) << shift
        above = before.gather(1, crossing)  # [rows, 1]
    tie = bits == prefix  # [rows, vocab]: the crossing token's probability; these are kept in id order
    tie_mass = mass.masked_fill_(~tie, 0)
    tie_before = bucket.copy_(tie_mass).cumsum_(dim=-1).sub_(tie_mass)
    return (tie_before < target - above).logical_and_(tie).logical_or_(bits > prefix)


def _gumbel(seed: torch.Tensor, counter: torch.Tensor, vocab: int) -> torch.Tensor:
    """[draws, vocab] float32 standard Gumbel noise, a function of (seed, counter, vocabulary id) only."""
    hi, lo = (seed >> 32) & _MASK32, seed & _MASK32  # [draws] each: the seed's two 32-bit halves
    key = _mix32_(hi ^ _mix32_(lo ^ _mix32_(counter & _MASK32)))  # [draws]: distinct for distinct counters
    spread = (torch.arange(vocab, device=seed.device) * _SPREAD) & _MASK32  # [vocab]
    h = torch.bitwise_xor(key[:, None], spread[None, :])  # [draws, vocab]
    h = _mix32_(h)  # a bijection of the id within each row
    u = h.bitwise_right_shift_(32 - _UNIFORM_BITS).float().add_(0.5).mul_(2.0**-_UNIFORM_BITS)
    # float32 rounds the top cell's 1 - 2**-25 up to 1.0, whose noise would be +inf: that id would win any
    # draw, and beside a -inf (a masked or truncated id) it would give NaN, which max() picks.
    u.clamp_(max=1.0 - 2.0**-_UNIFORM_BITS)
    return u.log_().neg_().log_().neg_()


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """Mixes ``x``, 32-bit values held in int64, in place: a bijection, each output bit depending on
    every input bit. In place with one scratch buffer, as fresh [draws, vocab] tensors cost a CPU more
    than the arithmetic."""
    tmp = torch.empty_like(x)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))
    x.mul_(_MUL1).bitwise_and_(_MASK32)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 15, out=tmp))
    x.mul_(_MUL2).bitwise_and_(_MASK32)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))


def _signed64(seed: int) -> int:
    """A 64-bit unsigned seed as the int64 with the same bits."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed
