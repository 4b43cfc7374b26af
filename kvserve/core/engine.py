"""``LLMEngine``: requests in, one scheduler step at a time, ``RequestOutput``s out.

The engine is the loop: each ``step()`` asks the scheduler what to run, hands it to the executor (which runs it
in this process or over a tensor-parallel group), lets the scheduler apply what the step reported, and lets the
output processor turn the logits into tokens, text and outputs. ``core/engine_builder.py`` assembles the parts
and ``core/output_processor.py`` does sampling, ``n``/``best_of``, beam search, stops, detokenisation and prompt
logprobs. The server and the offline ``LLM`` both drive this loop.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence as Seq
from typing import Any

from kvserve.config import EngineConfig
from kvserve.core.engine_builder import build_engine
from kvserve.core.isolation import GLOBAL_NAMESPACE, check_cache_salt, prefix_salt
from kvserve.core.kv_plan import request_policy
from kvserve.core.output_processor import OutputProcessor
from kvserve.core.outputs import RequestOutput
from kvserve.core.request import Request, Sequence
from kvserve.core.tier_faults import TierFaultRecovery
from kvserve.errors import KVTierError
from kvserve.kv.manager import KVUsage
from kvserve.log import get_logger
from kvserve.models.loader import LoadedModel
from kvserve.policies import KVPolicy
from kvserve.prompt_cache.cache import PreparedPrompt, check_module_prompt
from kvserve.prompt_cache.cached_module import CachedModule
from kvserve.prompt_cache.pml import is_pml_prompt
from kvserve.prompt_cache.store import EncodeJob
from kvserve.sampling.sampling_params import SamplingParams
from kvserve.structured.params import GuidedDecodingParams


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.closed = False
        parts = self.parts = build_engine(config, loaded)  # closed by close()
        self.loaded, self.plan, self.kv, self.prompt_cache = parts.loaded, parts.plan, parts.kv, parts.prompt_cache
        self.executor, self.scheduler, self.runner = parts.executor, parts.scheduler, parts.executor.runner
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = parts.max_model_len
        self.kv_policy = self.plan.policy
        self.kv_block_bytes = self.plan.block_bytes  # one block of the pool (of one layer, with per-layer groups)
        self.requests: dict[str, Request] = {}
        self._seqs: dict[int, tuple[Request, Sequence]] = {}
        self.outputs = OutputProcessor(
            self.tokenizer, self.loaded.config.vocab_size, self.scheduler, self._seqs, self.max_model_len,
            config.batch_invariant,
        )  # fmt: skip
        self._pinned_modules: dict[str, list[CachedModule]] = {}  # request id -> Prompt Cache modules it pins
        self._encodings: dict[int, EncodeJob] = {}  # module sequence -> its encoding, while the scheduler runs it
        self.tier_faults = TierFaultRecovery(self.scheduler, self.runner.cache, self.kv)
        self._request_ids = itertools.count()
        self.kv_summary = self.plan.summary(
            config.block_size, self.loaded.config.num_layers, config.kv_quant or config.kv_dtype(self.loaded.dtype)
        )
        get_logger().info(self.kv_summary)

    @property
    def tensor_parallel(self):  # noqa: ANN201 - kvserve.parallel.tensor_group.TensorParallelGroup | None
        return self.executor.tensor_parallel

    @property
    def parallel_prefill(self):  # noqa: ANN201 - kvserve.parallel.prefill.ParallelPrefill | None
        return self.executor.parallel_prefill

    @property
    def guided_mask_seconds(self) -> float:
        return self.outputs.guided_mask_seconds

    @property
    def guided_mask_steps(self) -> int:
        return self.outputs.guided_mask_steps

    def health_error(self) -> str | None:
        """Why this engine cannot serve any more (a lost tensor-parallel rank), or None while it can."""
        return self.executor.health_error()

    def close(self) -> None:
        """Release what a dropped engine would hold until exit: the parallel prefill workers, their process
        group and supervisor thread, the tensor-parallel ranks, the offload tier's transfer thread (a disk tier's
        file is unlinked when mapped). Aborts unfinished requests; idempotent; the engine takes no request
        afterwards. Another engine with parallel prefill may then start in this process."""
        if self.closed:
            return
        self.closed = True
        for request_id in list(self.requests):
            self.abort_request(request_id)
        self.parts.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----- Prompt Cache schemas -----

    def register_schema(self, pml_text: str, namespace: str = GLOBAL_NAMESPACE) -> dict:
        """Register a PML schema (in ``namespace``: ``kvserve/core/isolation.py``); its modules are encoded now
        (``prompt_cache_encode="eager"``) or on first use."""
        self._check_prompt_cache()
        try:
            return self.prompt_cache.register(pml_text, namespace).to_dict()
        finally:
            self._queue_encodings()

    def encode_modules(self) -> None:
        """Step until every module encoding queued so far is done: for a caller that drives the engine itself
        (the offline API, benchmarks) and wants eagerly registered modules ready before its first prompt. The
        steps also run whatever else is scheduled; their outputs are dropped, so call it between requests."""
        while self.scheduler.encoding:
            self.step()

    def _queue_encodings(self) -> None:
        """Hand the modules the store allocated to the scheduler: each is encoded by a prefill of its own tokens
        at its schema positions, admitted and chunked like any prompt (FCFS: before the prompts importing it)."""
        for job in self.prompt_cache.store.take_encode_jobs():
            module = job.module
            seq = Sequence(job.seq_id, list(job.token_ids), len(job.token_ids), None, None, job.computed)
            request = Request(
                f"prompt-cache:{module.key[0]}/{module.key[1]}", None, list(job.token_ids), _ENCODE_PARAMS, [seq],
                prompt_positions=job.positions, encodes_module=True, kv_policy=self.kv_policy,
                cache_salt=job.cache_salt,
            )  # fmt: skip
            self._encodings[job.seq_id] = job
            self.scheduler.add(request)

    def _check_prompt_cache(self) -> None:
        refusal = self.plan.prompt_cache_refusal(self.config)
        if refusal:
            raise ValueError(refusal)

    # ----- requests -----

    def add_request(
        self,
        prompt: str | Seq[int],
        params: SamplingParams,
        request_id: str | None = None,
        add_special_tokens: bool = True,
        score_from: int = 0,
        cache_salt: str | None = None,
        namespace: str = GLOBAL_NAMESPACE,
    ) -> str:
        """Queue a request (text or token ids); returns its id. Raises ValueError for a bad request.

        ``score_from``: with ``prompt_logprobs``, only positions from there on are needed; the tokens
        before it run in steps of their own, so a compressing KV policy compresses that context first
        (how the eval tools score a continuation under compression).
        ``cache_salt`` (vLLM's): prompts share prefix-cache blocks only with prompts of the same salt.
        ``namespace``: whose schemas a PML prompt names, and whose prefix blocks a plain prompt may share
        (``kvserve/core/isolation.py``; the caller's API key's, on a server with several)."""
        if self.closed:
            raise RuntimeError("the engine is closed (close() was called): build a new one")
        self.executor.check()  # a lost rank: refuse now rather than fail at the next step
        request_id = request_id if request_id is not None else str(next(self._request_ids))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        check_cache_salt(cache_salt, is_pml_prompt(prompt))
        if is_pml_prompt(prompt):
            return self._add_pml_request(prompt, params, request_id, score_from, namespace)
        ids = self.tokenizer.encode(prompt, add_special_tokens) if isinstance(prompt, str) else list(prompt)
        return self._queue(request_id, text, ids, params, score_from, salt=prefix_salt(namespace, cache_salt))

    def _add_pml_request(
        self, pml_text: str, params: SamplingParams, request_id: str, score_from: int, namespace: str
    ) -> str:
        """A Prompt Cache prompt: its modules' KV pinned for the request's lifetime, the rest computed."""
        arrival = time.monotonic()  # pinning (and a lazy encoding) is part of the time to first token
        self._check_prompt_cache()
        check_module_prompt(self.policy_for(params), params, score_from)
        try:
            prepared = self.prompt_cache.prepare(pml_text, namespace)
        finally:
            self._queue_encodings()
        try:
            return self._queue(request_id, pml_text, prepared.token_ids, params, 0, prepared, arrival)
        except Exception:
            self.prompt_cache.release(prepared.modules)
            raise

    def _queue(
        self, request_id: str, text: str | None, ids: list[int], params: SamplingParams, score_from: int,
        prepared: PreparedPrompt | None = None, arrival: float | None = None, salt: tuple = (),
    ) -> str:  # fmt: skip
        self.validate_prompt(ids)
        self.validate_params(params)
        if params.best_of > self.config.max_num_seqs:
            raise ValueError(
                f"best_of={params.best_of} sequences can never run side by side with max_num_seqs="
                f"{self.config.max_num_seqs}"
            )
        policy = self.policy_for(params)
        if not 0 <= score_from < len(ids):
            raise ValueError(f"score_from={score_from} must be in [0, {len(ids)}) for a prompt of {len(ids)} tokens")
        seq = self.outputs.new_sequence(ids, len(ids), params, seed_offset=0)
        cached = {"cache_salt": salt} if prepared is None else {
            "prompt_positions": tuple(prepared.positions), "prompt_cache": prepared.cached, "cache_salt": prepared.salt,
            "arrival_time": arrival,
        }  # fmt: skip
        request = Request(request_id, text, ids, params, [seq], kv_policy=policy, score_from=score_from, **cached)
        self.outputs.start(request)
        if prepared is not None:
            self._pinned_modules[request_id] = prepared.modules
        if params.prompt_logprobs is not None:
            # Every prompt position needs its logits, so cached blocks cannot stand in for them.
            request.cache_salt = ("prompt_logprobs", request_id)
        self.requests[request_id] = request
        self._seqs[seq.seq_id] = (request, seq)
        self.scheduler.add(request)
        return request_id

    def policy_for(self, params: SamplingParams) -> KVPolicy:
        """The request's KV policy: the engine's, unless ``params`` names another policy or budget."""
        return request_policy(self.plan, self.config, params, self.loaded.config.num_layers)

    def validate_prompt(self, ids: list[int]) -> None:
        """Raise ValueError for a prompt that can never run. Reads only fixed sizes, so any thread may call it."""
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; the context is {self.max_model_len} tokens, and at least one "
                "must be left to generate"
            )
        bad = [i for i in ids if not 0 <= i < self.loaded.config.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.loaded.config.vocab_size})")
        capacity = self.kv.pool.num_blocks * self.kv.block_size
        if len(ids) > capacity:
            raise ValueError(f"the prompt has {len(ids)} tokens; the whole KV cache holds {capacity} tokens")

    def validate_params(self, params: SamplingParams) -> None:
        """Raise ValueError for sampling options this model cannot honour (any thread may call it)."""
        vocab = self.loaded.config.vocab_size
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids), ("logit_bias", list(params.logit_bias or ())),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):  # fmt: skip
            bad = [i for i in ids if not 0 <= i < vocab]
            if bad:
                raise ValueError(
                    f"{name} {bad[:5]} are outside the model's vocabulary of {vocab} tokens (ids 0 to {vocab - 1})"
                )

    def compile_grammar(self, guided: GuidedDecodingParams) -> Any:  # xgrammar's CompiledGrammar
        """The constraint compiled against this engine's tokenizer (cached by the constraint)."""
        return self.outputs.compile_grammar(guided)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.live_seqs:
            seq.finish_reason = "abort"
        self._release(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def kv_usage(self) -> KVUsage:
        return self.kv.usage()

    # ----- the loop -----

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration; returns outputs of every request that advanced or finished."""
        out = self.scheduler.schedule()
        touched: dict[str, Request] = {}
        for request_id in out.rejected:
            request = self.requests[request_id]
            for seq in request.live_seqs:
                seq.finish_reason, seq.stop_reason = "length", "kv_cache_capacity"
                if request.params.use_beam_search:
                    request.finished_beams.append(seq)
            touched[request_id] = request
        rows_from = self.outputs.prompt_logprob_rows(out)
        try:
            result = self.executor.execute_step(out, rows_from)
        except KVTierError as error:
            recovered = self.tier_faults.recover(out, error, self._seqs, self.requests, self._fail)
            return [self._finish_or_report(request) for request in touched.values()] + recovered
        for seq_id in self.scheduler.update(out, result.report):
            self.prompt_cache.store.finish_encoding(self._encodings.pop(seq_id))
        touched.update(self.outputs.process(out, result, rows_from))
        return [self._finish_or_report(request) for request in touched.values()]

    def _fail(self, request: Request, error: Exception) -> RequestOutput:
        """End ``request`` with finish_reason "error" and ``error``'s message."""
        for seq in request.live_seqs:
            seq.finish_reason = "error"
        self._release(request)
        return dataclasses.replace(self.outputs.output(request), error=str(error))

    def _finish_or_report(self, request: Request) -> RequestOutput:
        for seq in request.seqs:
            if seq.finished and seq.seq_id in self.kv:
                self.scheduler.free_sequence(seq)
        if not request.live_seqs:
            self._release(request)
        return self.outputs.output(request)

    def _release(self, request: Request) -> None:
        self.scheduler.finish(request)
        self.requests.pop(request.request_id, None)
        for seq in request.seqs:
            self._seqs.pop(seq.seq_id, None)
        self.outputs.forget(request)
        self.tier_faults.forget(request.request_id)
        self.prompt_cache.release(self._pinned_modules.pop(request.request_id, []))
        request.finish_time = time.monotonic()


_ENCODE_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)  # a module's encoding samples nothing
