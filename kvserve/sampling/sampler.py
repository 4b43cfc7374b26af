"""Logits -> next tokens for a batch of sequences, each with its own parameters and generator.

Order of operations (vLLM's): penalties on the raw logits, then logit_bias / allowed tokens / the
grammar mask of guided decoding (``structured/``), then temperature, then top-k, top-p
and min-p filters, then a draw from the row's own ``torch.Generator`` (greedy rows take the
argmax). Reported logprobs are those of the raw model distribution, as vLLM reports by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.sampling.sampling_params import SamplingParams


@dataclass
class SampleRow:
    """What the sampler needs to know about one sequence."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    banned_token_ids: Sequence[int] = ()  # never sampled this step (stop tokens before min_tokens)
    token_bitmask: torch.Tensor | None = None  # guided decoding: (1, ceil(V / 32)) int32, the tokens allowed


@dataclass
class SampledToken:
    token_id: int
    logprob: float  # raw model log-probability of token_id
    top_logprobs: dict[int, float] | None = None  # params.logprobs most likely tokens, plus token_id


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator owned by one sequence, so its samples do not depend on the rest of the batch."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One row: logits (vocab,) float32 -> token id."""
    return sample_batch(logits.unsqueeze(0), [SampleRow(params, generator)])[0].token_id


def sample_batch(logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[SampledToken]:
    """logits (B, vocab) float32, one row per sequence -> one sampled token per row."""
    processed = constrain(steer(apply_penalties(logits, rows), rows, logits), rows, logits)
    greedy = [i for i, row in enumerate(rows) if row.params.greedy]
    if len(greedy) == len(rows):
        chosen = processed.argmax(dim=-1)
    else:
        chosen = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        if greedy:
            chosen[greedy] = processed[greedy].argmax(dim=-1)
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        probs = filtered_probs(processed[random], [rows[i].params for i in random])
        for j, i in enumerate(random):
            chosen[i] = torch.multinomial(probs[j], 1, generator=rows[i].generator)[0]
    # The chosen tokens' raw log-probabilities need one logsumexp per row, not a (B, V) log-softmax;
    # that is computed only when a row asks for its top logprobs.
    token_logprobs = (logits.gather(1, chosen.unsqueeze(1)).squeeze(1) - torch.logsumexp(logits, dim=-1)).tolist()
    tokens = chosen.tolist()
    raw_logprobs = None
    results = []
    for i, row in enumerate(rows):
        if row.params.logprobs is None:
            results.append(SampledToken(tokens[i], token_logprobs[i]))
            continue
        if raw_logprobs is None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        results.append(_result(raw_logprobs[i], tokens[i], row.params.logprobs))
    return results


def apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens; presence and frequency over output tokens."""
    if not any(row.params.has_penalties for row in rows):
        return logits
    logits = logits.clone()
    for i, row in enumerate(rows):
        p = row.params
        if not p.has_penalties:
            continue
        if p.repetition_penalty != 1:
            seen = torch.tensor(sorted({*row.prompt_token_ids, *row.output_token_ids}), dtype=torch.long)
            if len(seen):
                values = logits[i, seen]
                penalised = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
                logits[i, seen] = penalised
        if (p.presence_penalty or p.frequency_penalty) and len(row.output_token_ids):
            counts = torch.bincount(torch.tensor(list(row.output_token_ids)), minlength=logits.shape[-1])
            counts = counts.to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def steer(processed: torch.Tensor, rows: Sequence[SampleRow], raw: torch.Tensor) -> torch.Tensor:
    """What a request asks of the choice itself: ``logit_bias`` added, only ``allowed_token_ids`` left, stop
    tokens banned before ``min_tokens``. ``raw`` (the logits logprobs are reported from) is never written to."""
    if not any(row.banned_token_ids or row.params.logit_bias or row.params.allowed_token_ids for row in rows):
        return processed
    processed = processed.clone() if processed is raw else processed
    for i, row in enumerate(rows):
        bias, allowed = row.params.logit_bias, row.params.allowed_token_ids
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.long, device=processed.device)
            processed[i, ids] += torch.tensor(list(bias.values()), dtype=processed.dtype, device=processed.device)
        if allowed:
            keep = processed[i, allowed].clone()
            processed[i] = float("-inf")
            processed[i, allowed] = keep
        if row.banned_token_ids:
            processed[i, list(row.banned_token_ids)] = float("-inf")
    return processed


def constrain(processed: torch.Tensor, rows: Sequence[SampleRow], raw: torch.Tensor) -> torch.Tensor:
    """Guided decoding: tokens outside a row's grammar get -inf, in the constrained rows only (the others pay
    nothing). ``raw`` is never written to: logprobs are reported from the model's own distribution."""
    constrained = [i for i, row in enumerate(rows) if row.token_bitmask is not None]
    if not constrained:
        return processed
    from kvserve.structured.matching import apply_bitmasks  # xgrammar loads only when a request is guided

    processed = processed.clone() if processed is raw else processed
    masks = [rows[i].token_bitmask for i in constrained]
    apply_bitmasks(processed, constrained, masks)
    # The grammar wins over allowed_token_ids and min_tokens' banned stop tokens: where together they leave
    # no token (the grammar only allows EOS, which min_tokens bans), the row keeps the grammar's choice alone.
    dead = [i for i, row in zip(constrained, processed[constrained].isinf().all(dim=-1).tolist(), strict=True) if row]
    if dead:
        processed[dead] = raw[dead]
        apply_bitmasks(processed, dead, [rows[i].token_bitmask for i in dead])
    return processed


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p per row: logits (B, V) -> probabilities (B, V)."""
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
    logits = logits / temperature
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab).unsqueeze(0)  # (1, V)
    top_k = torch.tensor([p.top_k if p.top_k != -1 else vocab for p in params]).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # top-p: drop a token when the more likely tokens before it already reach top_p (the first stays).
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype).unsqueeze(1)
    drop = (probs.cumsum(dim=-1) - probs) >= top_p
    # min-p: drop tokens less likely than min_p times the most likely one.
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype).unsqueeze(1)
    drop |= probs < min_p * probs[:, :1]
    probs = probs.masked_fill(drop, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.empty_like(probs).scatter_(1, order, probs)


def _result(logprobs: torch.Tensor, token: int, num_top: int | None) -> SampledToken:
    top = None
    if num_top is not None:
        top = top_logprobs(logprobs, num_top)
        top.setdefault(token, float(logprobs[token]))
    return SampledToken(token, float(logprobs[token]), top)


def top_logprobs(logprobs: torch.Tensor, k: int) -> dict[int, float]:
    """The k most likely tokens of a log-probability row (vocab,), most likely first."""
    if k == 0:
        return {}
    values, ids = torch.topk(logprobs, k)
    return dict(zip(ids.tolist(), values.tolist(), strict=True))


def sample_each(logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[SampledToken]:
    """``sample_batch`` one row at a time, for the batch-invariant mode: torch splits a lone row's reductions
    (logsumexp, softmax) across threads but reduces a batch row by row, so a row's logprobs and filtered
    probabilities would otherwise change in their last bits with the number of rows beside it."""
    return [sample_batch(logits[i : i + 1], [row])[0] for i, row in enumerate(rows)]
