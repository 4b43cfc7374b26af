"""From a step's logits to what each request says: sampling, ``n``/``best_of`` forks, beam search, stop checks,
detokenisation, prompt logprobs, and the ``RequestOutput`` a caller sees.

The engine hands it the step's scheduled work and the runner's logits; it changes requests and sequences (their
tokens, text, finish reasons) and asks the scheduler to fork or free a sequence's KV. It knows no KV technique.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any

import torch

from kvserve.core.outputs import CompletionOutput, RequestOutput
from kvserve.core.request import Request, Sequence
from kvserve.core.runner import RunnerOutput
from kvserve.core.scheduler import Scheduler
from kvserve.core.step import SchedulerOutput
from kvserve.platform.extras import extra_imports
from kvserve.sampling import beam_search
from kvserve.sampling.sampler import SampledToken, SampleRow, make_generator, sample_batch, sample_each
from kvserve.sampling.sampling_params import SamplingParams
from kvserve.sampling.stopping import find_stop, partial_stop_len
from kvserve.structured.params import GuidedDecodingParams
from kvserve.text.detokenizer import IncrementalDetokenizer


class OutputProcessor:
    """``seqs``: the engine's registry, seq_id -> (request, sequence); forks are added to it here."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        scheduler: Scheduler,
        seqs: dict[int, tuple[Request, Sequence]],
        max_model_len: int,
        batch_invariant: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.scheduler = scheduler
        self.seqs = seqs
        self.max_model_len = max_model_len
        self.batch_invariant = batch_invariant  # sample each row alone: the same tokens at any batch size
        self._seq_ids = itertools.count()
        self._pending_beams: dict[str, dict[int, torch.Tensor]] = {}  # request -> beam -> logits row
        self._grammar_cache = None  # structured/grammars.py GrammarCache, built at the first guided request
        self.guided_mask_seconds = 0.0  # time spent filling grammar masks, and the steps that filled any
        self.guided_mask_steps = 0

    # ----- sequences and grammars -----

    def new_sequence(self, ids: list[int], num_prompt: int, params: SamplingParams, seed_offset: int) -> Sequence:
        child = params if params.seed is None else dataclasses.replace(params, seed=params.seed + seed_offset)
        return Sequence(
            seq_id=next(self._seq_ids),
            token_ids=list(ids),
            num_prompt_tokens=num_prompt,
            generator=make_generator(child),  # sampling runs on the logits' CPU copy (runner.py), on any device
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens),
        )

    def compile_grammar(self, guided: GuidedDecodingParams) -> Any:  # xgrammar's CompiledGrammar
        """The constraint compiled against this tokenizer (cached by the constraint)."""
        if self._grammar_cache is None:
            with extra_imports("structured", "guided decoding"):
                from kvserve.structured.grammars import GrammarCache

            self._grammar_cache = GrammarCache(self.tokenizer, self.vocab_size)
        try:
            return self._grammar_cache.compile(guided)
        except RuntimeError as exc:
            raise ValueError(f"{guided.kind} cannot be compiled for this tokenizer: {exc}") from None

    def start(self, request: Request) -> None:
        """Ready a new request's first sequence: its grammar matcher, stop tokens and prompt logprob slots."""
        seq, params = request.seqs[0], request.params
        if params.guided_decoding is not None:
            request.grammar = self.compile_grammar(params.guided_decoding)
            seq.matcher = self._grammar_cache.new_matcher(request.grammar)
        eos = () if params.ignore_eos else self.tokenizer.eos_token_ids
        request.stop_token_ids = frozenset((*params.stop_token_ids, *eos))
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(request.prompt_token_ids)
            request.prompt_token_ranks = [None] * len(request.prompt_token_ids)

    def forget(self, request: Request) -> None:
        self._pending_beams.pop(request.request_id, None)

    # ----- a step's logits -----

    def prompt_logprob_rows(self, out: SchedulerOutput) -> dict[int, int]:
        """seq_id -> the first row of its chunk whose logits prompt logprobs need (from there on)."""
        rows = {}
        for s in out.scheduled:
            if s.seq_id not in self.seqs:  # a module's encoding
                continue
            request, seq = self.seqs[s.seq_id]
            if request.prompt_logprobs is None or s.num_computed_tokens >= seq.num_prompt_tokens:
                continue
            first = max(0, request.score_from - 1 - s.num_computed_tokens)  # row p predicts token p + 1
            if first < len(s.token_ids):
                rows[s.seq_id] = first
        return rows

    def process(self, out: SchedulerOutput, result: RunnerOutput, rows_from: Mapping[int, int]) -> dict[str, Request]:
        """Record prompt logprobs and sample every sequence the step finished a chunk of; returns the requests
        that advanced, by id."""
        touched: dict[str, Request] = {}
        sampled: dict[str, list[tuple[Sequence, torch.Tensor]]] = {}
        for s in out.scheduled:
            if s.seq_id not in self.seqs:  # a module's encoding: nothing to report
                continue
            request, seq = self.seqs[s.seq_id]
            touched[request.request_id] = request
            logits = result.logits[result.rows[s.seq_id]] if result.logits is not None else None
            if s.seq_id in rows_from:
                first = rows_from[s.seq_id]
                self._record_prompt_logprobs(request, s.num_computed_tokens + first, s.token_ids[first:], logits)
            if s.samples:
                sampled.setdefault(request.request_id, []).append((seq, logits[-1]))
        self._sample(touched, sampled)
        return touched

    def _record_prompt_logprobs(self, request: Request, start: int, chunk: Seq[int], logits: torch.Tensor) -> None:
        """Row i of the chunk (position start + i) predicts the prompt token at start + i + 1."""
        prompt = request.prompt_token_ids
        rows = min(len(chunk), len(prompt) - start - 1)  # the last prompt token predicts no prompt token
        if rows <= 0:
            return
        logprobs = torch.log_softmax(logits[:rows], dim=-1)  # (rows, vocab); batched: evals score long windows
        targets = torch.tensor(prompt[start + 1 : start + 1 + rows], dtype=torch.long, device=logprobs.device)
        chosen_t = logprobs.gather(1, targets[:, None])
        ranks = ((logprobs > chosen_t).sum(dim=-1) + 1).tolist()  # as vLLM: 1 + the tokens more likely
        chosen = chosen_t[:, 0].tolist()
        k = request.params.prompt_logprobs
        top_ids, top_values = ([[]] * rows, [[]] * rows)
        if k:  # max is several times faster than topk for the common k=1 (evals ask for it)
            values, ids = logprobs.max(dim=-1, keepdim=True) if k == 1 else torch.topk(logprobs, k, dim=-1)
            top_ids, top_values = ids.tolist(), values.tolist()
        for i in range(rows):
            entry = dict(zip(top_ids[i], top_values[i], strict=True))
            entry[prompt[start + 1 + i]] = chosen[i]
            request.prompt_logprobs[start + 1 + i] = entry
            request.prompt_token_ranks[start + 1 + i] = ranks[i]

    def _sample(self, requests: Mapping[str, Request], sampled: dict[str, list[tuple[Sequence, torch.Tensor]]]) -> None:
        rows: list[tuple[Request, Sequence]] = []
        logits: list[torch.Tensor] = []
        for request_id, items in sampled.items():
            request = requests[request_id]
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            if request.params.use_beam_search:
                self._beam_step(request, items)
                continue
            for seq, row in items:
                for child in self._fork_for_best_of(request, seq):
                    rows.append((request, child))
                    logits.append(row)
        if not rows:
            return
        masks = self._grammar_masks([s for _, s in rows])
        sample_rows = [
            SampleRow(r.params, s.generator, r.prompt_token_ids, s.output_token_ids, _banned(r, s), mask)
            for (r, s), mask in zip(rows, masks, strict=True)
        ]
        sample = sample_each if self.batch_invariant else sample_batch
        for (request, seq), token in zip(rows, sample(torch.stack(logits), sample_rows), strict=True):
            self._append_token(request, seq, token)

    def _grammar_masks(self, seqs: list[Sequence]) -> list[torch.Tensor | None]:
        """Each guided sequence's allowed next tokens (None for the rest, which cost nothing)."""
        if all(s.matcher is None for s in seqs):
            return [None] * len(seqs)
        start = time.perf_counter()
        masks = self._grammar_cache.fill_bitmasks([s.matcher for s in seqs])
        self.guided_mask_seconds += time.perf_counter() - start
        self.guided_mask_steps += 1
        return masks

    def _fork(self, request: Request, parent: Sequence, seed_offset: int) -> Sequence:
        """A sequence that starts where ``parent`` is, sharing its KV blocks (copy-on-write)."""
        child = self.new_sequence(parent.token_ids, parent.num_prompt_tokens, request.params, seed_offset)
        self.scheduler.fork(parent, child)
        request.seqs.append(child)
        self.seqs[child.seq_id] = (request, child)
        return child

    def _fork_for_best_of(self, request: Request, seq: Sequence) -> list[Sequence]:
        """After the prompt, one sequence becomes best_of sequences sharing its blocks."""
        if not request.prefilling or request.params.best_of == 1:
            return [seq]
        for i in range(1, request.params.best_of):
            child = self._fork(request, seq, seed_offset=i)
            child.matcher = self._grammar_cache.new_matcher(request.grammar) if request.grammar is not None else None
        return list(request.seqs)

    def _beam_step(self, request: Request, items: list[tuple[Sequence, torch.Tensor]]) -> None:
        """Advance beam search once every live beam has its next-token logits."""
        pending = self._pending_beams.setdefault(request.request_id, {})
        for seq, row in items:
            pending[seq.seq_id] = row
        live = request.live_seqs
        if any(seq.seq_id not in pending for seq in live):
            return  # a beam is still catching up (recomputed after preemption)
        del self._pending_beams[request.request_id]
        params, width = request.params, request.params.best_of
        logprobs = torch.log_softmax(torch.stack([pending[s.seq_id] for s in live]), dim=-1)
        candidates = beam_search.propose(logprobs, [s.cumulative_logprob for s in live], width)
        stop_ids = request.stop_token_ids
        new_beams: list[tuple[Sequence, beam_search.Candidate]] = []
        used: set[int] = set()
        for rank, cand in enumerate(candidates):
            parent = live[cand.parent]
            if cand.token_id in stop_ids:
                if rank < width:  # as Hugging Face: only a stop among the top `width` ends a hypothesis
                    self._add_finished_beam(request, parent, cand)
                continue
            if len(new_beams) == width:
                continue
            if cand.parent in used:
                beam = self._fork(request, parent, 0)
                _copy_output(parent, beam)
            else:
                used.add(cand.parent)
                beam = parent
            new_beams.append((beam, cand))
        for i, parent in enumerate(live):
            if i not in used:  # pruned
                parent.finish_reason = "pruned"
                self.scheduler.free_sequence(parent)
        for beam, cand in new_beams:
            self._append_token(request, beam, SampledToken(cand.token_id, cand.logprob, None), beam=True)
            if beam.finished:  # reached max_tokens or a stop string
                request.finished_beams.append(beam)
        still = request.live_seqs
        finished_scores = [_beam_score(request, s) for s in request.finished_beams]
        if not still or beam_search.is_done(
            finished_scores, max(s.cumulative_logprob for s in still), len(still[0].output_token_ids), width,
            params.length_penalty,
        ):  # fmt: skip
            for seq in still:
                seq.finish_reason = seq.finish_reason or "stop"
                self._add_finished_beam(request, seq, None)

    def _add_finished_beam(self, request: Request, parent: Sequence, cand: beam_search.Candidate | None) -> None:
        if cand is None:
            request.finished_beams.append(parent)
            return
        done = self.new_sequence(parent.token_ids, parent.num_prompt_tokens, request.params, 0)
        _copy_output(parent, done)
        done.token_ids.append(cand.token_id)
        done.cumulative_logprob += cand.logprob
        done.finish_reason, done.stop_reason = "stop", cand.token_id
        request.finished_beams.append(done)

    # ----- per token -----

    def _append_token(self, request: Request, seq: Sequence, token: SampledToken, beam: bool = False) -> None:
        params = request.params
        seq.token_ids.append(token.token_id)
        seq.cumulative_logprob += token.logprob
        if params.logprobs is not None:
            seq.logprobs.append(token.top_logprobs or {token.token_id: token.logprob})
        grammar_done = seq.matcher is not None and self._grammar_cache.accept(seq.matcher, token.token_id)
        if not beam and (token.token_id in request.stop_token_ids or grammar_done):
            seq.finish_reason, seq.stop_reason = "stop", token.token_id
            return
        searched = len(seq.text)
        seq.text += seq.detokenizer.step(token.token_id)
        early = len(seq.output_token_ids) <= params.min_tokens  # vLLM: stop strings count after min_tokens
        stop = None if early else find_stop(seq.text, params.stop, searched)
        if stop is not None:
            seq.text = seq.text[: stop[0] + len(stop[1]) if params.include_stop_str_in_output else stop[0]]
            seq.finish_reason, seq.stop_reason = "stop", stop[1]
        elif (
            len(seq.output_token_ids) >= params.max_tokens
            or request.position_of(seq.num_tokens) >= self.max_model_len  # Prompt Cache: positions run ahead
        ):
            seq.finish_reason = "length"

    # ----- what the caller sees -----

    def output(self, request: Request) -> RequestOutput:
        params = request.params
        finished = request.finished
        if params.use_beam_search:
            pool = request.finished_beams if finished else request.live_seqs
            chosen = sorted(pool, key=lambda s: _beam_score(request, s), reverse=True)[: params.n]
        elif finished and params.best_of > params.n:
            chosen = sorted(request.seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
        else:
            chosen = request.seqs[: params.n]
        outputs = [_completion(i, seq, params, finished) for i, seq in enumerate(chosen)]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=request.prompt_logprobs,
            prompt_token_ranks=request.prompt_token_ranks,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=request.num_cached_prompt_tokens,
            metrics={
                "arrival_time": request.arrival_time,
                "first_token_time": request.first_token_time or 0.0,
                "finish_time": request.finish_time or 0.0,
            },
        )


def _completion(index: int, seq: Sequence, params: SamplingParams, finished: bool) -> CompletionOutput:
    # While streaming, hold back a tail that may still become a stop string.
    held = 0 if (finished or seq.finished) else partial_stop_len(seq.text, params.stop)
    visible = len(seq.text) - held
    seq.emitted_chars = max(seq.emitted_chars, visible)
    return CompletionOutput(
        index=index,
        text=seq.text[:visible],
        token_ids=list(seq.output_token_ids),
        cumulative_logprob=seq.cumulative_logprob,
        logprobs=list(seq.logprobs) if params.logprobs is not None else None,
        finish_reason=seq.finish_reason if seq.finish_reason != "pruned" else "stop",
        stop_reason=seq.stop_reason,
    )


def _beam_score(request: Request, seq: Sequence) -> float:
    return beam_search.beam_score(seq.cumulative_logprob, len(seq.output_token_ids), request.params.length_penalty)


def _banned(request: Request, seq: Sequence) -> tuple[int, ...]:
    """The stop tokens while a sequence is shorter than min_tokens: it must not end yet."""
    return tuple(request.stop_token_ids) if len(seq.output_token_ids) < request.params.min_tokens else ()


def _copy_output(parent: Sequence, child: Sequence) -> None:
    """What a beam's sequence has produced so far (its KV progress the scheduler's fork copied)."""
    child.token_ids = list(parent.token_ids)
    child.cumulative_logprob = parent.cumulative_logprob
    child.logprobs = list(parent.logprobs)
    child.text = parent.text
    child.emitted_chars = parent.emitted_chars
