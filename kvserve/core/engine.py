"""``LLMEngine``: requests in, one scheduler step at a time, ``RequestOutput``s out.

Each ``step()`` asks the scheduler what to run, lets the runner run it over the paged KV cache,
samples, and updates the requests: counters, prefix-cache registration, detokenisation, stop
checks, forking into ``best_of`` samples after the prompt, and beam search. The server and the
offline ``LLM`` both drive this loop.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence as Seq
from typing import Any

import torch

from kvserve.config import HEAD_BUDGETS_AND_MODULES, EngineConfig
from kvserve.core.isolation import GLOBAL_NAMESPACE, check_cache_salt, prefix_salt
from kvserve.core.kv_cache import make_kv_cache
from kvserve.core.kv_plan import plan_kv, request_policy
from kvserve.core.outputs import CompletionOutput, RequestOutput
from kvserve.core.request import Request, RequestStatus, Sequence
from kvserve.core.runner import ModelRunner
from kvserve.core.scheduler import Scheduler, SchedulerConfig
from kvserve.core.step import SchedulerOutput
from kvserve.errors import KVTierError
from kvserve.kv.manager import KVCacheManager, KVUsage
from kvserve.log import get_logger
from kvserve.models.loader import LoadedModel, load_model
from kvserve.platform.cpu_kernels import prepare_cpu_kernels
from kvserve.platform.extras import extra_imports
from kvserve.policies import KVPolicy
from kvserve.prompt_cache.cache import PreparedPrompt, PromptCache
from kvserve.prompt_cache.cached_module import CachedModule
from kvserve.prompt_cache.disk import ModuleFiles, model_fingerprint
from kvserve.prompt_cache.pml import is_pml_prompt
from kvserve.prompt_cache.store import EncodeJob, ModuleStore
from kvserve.sampling import beam_search
from kvserve.sampling.sampler import SampledToken, SampleRow, make_generator, sample_batch, sample_each
from kvserve.sampling.sampling_params import SamplingParams
from kvserve.sampling.stopping import find_stop, partial_stop_len
from kvserve.structured.params import GuidedDecodingParams
from kvserve.text.detokenizer import IncrementalDetokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.closed = False
        self.tensor_parallel = self._start_tensor_parallel() if config.tensor_parallel_size > 1 else None
        try:
            self._build(config, loaded)
        except BaseException:
            if self.tensor_parallel is not None:
                self.tensor_parallel.close()
                torch.set_num_threads(self._threads_before)
            raise

    def _build(self, config: EngineConfig, loaded: LoadedModel | None) -> None:
        shard = self.tensor_parallel.shard if self.tensor_parallel is not None else None
        if loaded is not None and loaded.shard != shard:
            raise ValueError(f"the model given was loaded with shard={loaded.shard}, this engine runs shard={shard}")
        # On a CPU the compiled kernels load (or build, the first time, with a log line) before the engine takes
        # a request: no first request's TTFT includes a compile. Cheap when cached; nothing on CUDA.
        prepare_cpu_kernels(config.device)
        self.loaded = loaded or load_model(
            config.model, config.torch_dtype, config.device, weights=config.weights,
            batch_invariant=config.batch_invariant, tokenizer=config.tokenizer, chat_template=config.chat_template,
            shard=shard, int8_activations=config.int8_activations,
        )  # fmt: skip
        if config.batch_invariant and not self.loaded.batch_invariant:
            raise ValueError("batch_invariant=True needs a model loaded with load_model(..., batch_invariant=True)")
        if config.int8_activations and not self.loaded.int8_activations:
            raise ValueError("int8_activations=True needs a model loaded with load_model(..., int8_activations=True)")
        self.tokenizer = self.loaded.tokenizer
        cfg = self.loaded.config
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.plan = plan_kv(config, cfg, self.loaded.dtype)  # raises when this model cannot run the configuration
        self.kv_policy = self.plan.policy
        self.kv_block_bytes = self.plan.block_bytes  # one block of the pool (of one layer, with per-layer groups)
        self.kv = KVCacheManager(
            self.plan.num_blocks, config.block_size, groups=list(self.plan.groups(cfg.num_layers)),
            num_host_blocks=self.plan.num_host_blocks, enable_prefix_caching=self.plan.prefix_caching,
        )  # fmt: skip
        self.parallel_prefill = self._start_parallel_prefill() if config.prefill_parallel > 1 else None
        cache = make_kv_cache(config, self.plan, self.loaded)
        if self.tensor_parallel is not None:  # the workers have loaded their shards: meet them
            self.tensor_parallel.join(self.loaded.model, cache)
        self.runner = ModelRunner(self.loaded.model, cache, config.device, self.parallel_prefill, self.tensor_parallel)
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                config.preemption_mode,
                self.plan.per_layer_groups,
                layer_windows=self.plan.group_windows(cfg.layer_windows),
                same_step_prefix_hits=self.plan.same_step_prefix_hits,
                positioned_windows=self.plan.windowed and len(self.plan.layout.groups) == 1,
            ),
            self.kv,
        )
        self.prompt_cache = self._make_prompt_cache()
        self.requests: dict[str, Request] = {}
        self._seqs: dict[int, tuple[Request, Sequence]] = {}
        self._pinned_modules: dict[str, list[CachedModule]] = {}  # request id -> Prompt Cache modules it pins
        self._pending_beams: dict[str, dict[int, torch.Tensor]] = {}  # request -> beam -> logits row
        self._encodings: dict[int, EncodeJob] = {}  # module sequence -> its encoding, while the scheduler runs it
        self._tier_faulted: set[str] = set()  # requests recomputed once after a KV tier fault (a second one ends them)
        self._seq_ids = itertools.count()
        self._grammar_cache = None  # structured/grammars.py GrammarCache, built at the first guided request
        self.guided_mask_seconds = 0.0  # time spent filling grammar masks, and the steps that filled any
        self.guided_mask_steps = 0
        self._request_ids = itertools.count()
        self.kv_summary = self.plan.summary(config.block_size, cfg.num_layers, config.kv_dtype(self.loaded.dtype))
        get_logger().info(self.kv_summary)

    def _make_prompt_cache(self) -> PromptCache:
        config, plan = self.config, self.plan
        # Device-tier modules live in the KV pool: at most half of it, so requests always have room to run.
        module_budget = config.prompt_cache_bytes
        if config.prompt_cache_tier == "device":
            module_budget = min(module_budget, plan.num_blocks * plan.block_bytes // 2)
        files = None
        if config.prompt_cache_dir is not None:
            files = ModuleFiles(config.prompt_cache_dir, model_fingerprint(self.loaded, config))
        store = ModuleStore(
            self.kv, self.runner.cache, config.prompt_cache_tier, module_budget, plan.block_bytes // config.block_size,
            plan.per_layer_groups, files,
        )  # fmt: skip
        eager = config.prompt_cache_encode == "eager"
        # A module encoded after the schema's prefix is copied out of a scratch sequence: in this process, one
        # group for every layer (see config.prompt_cache_context).
        context = config.prompt_cache_context == "prefix" and not plan.per_layer_groups and self.tensor_parallel is None
        windows = self.loaded.config.layer_windows
        # Recompute selects by layer 1's KV deviation: a window on layer 0 bounds which tokens can deviate there.
        probe_window = windows[0] if len(windows) > 1 else None
        return PromptCache(
            self.tokenizer, self.max_model_len, store, eager, config.prompt_cache_recompute, module_context=context,
            probe_window=probe_window,
        )  # fmt: skip

    def _start_tensor_parallel(self):  # noqa: ANN202 - kvserve.parallel.tensor_group.TensorParallelGroup
        """Spawn this machine's other ranks (they load their shards while this process loads its own); this
        process computes with its share of the cores from now on."""
        from kvserve.parallel.tensor_group import TensorParallelGroup

        if self.config.node_rank != 0:
            raise ValueError(
                f"node_rank={self.config.node_rank} runs tensor-parallel workers only (`kvserve serve --node-rank "
                f"{self.config.node_rank}` does that); the engine runs on node 0"
            )
        group = TensorParallelGroup(self.config)
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(group.threads)
        return group

    def health_error(self) -> str | None:
        """Why this engine cannot serve any more (a lost tensor-parallel rank), or None while it can."""
        if self.tensor_parallel is not None and self.tensor_parallel.failure is not None:
            return f"the tensor-parallel group is lost: {self.tensor_parallel.failure}"
        return None

    def _start_parallel_prefill(self):  # noqa: ANN202 - kvserve.parallel.prefill.ParallelPrefill
        from kvserve.models.dtype import DTYPE_NAMES
        from kvserve.parallel import partition
        from kvserve.parallel.group import WorkerModel
        from kvserve.parallel.prefill import ParallelPrefill

        choice = self.config.prefill_partition
        if choice is None:
            choice = "predicted" if partition.default_table_path().is_file() else "even"
        worker_model = WorkerModel(str(self.loaded.path), DTYPE_NAMES[self.loaded.dtype], self.config.weights)
        return ParallelPrefill(self.loaded.model, worker_model, self.config.prefill_parallel, choice)

    def close(self) -> None:
        """Release what a dropped engine would hold until exit: the parallel prefill workers, their process
        group and supervisor thread, the offload tier's transfer thread (a disk tier's file is unlinked when
        mapped). Aborts unfinished requests; idempotent; the engine takes no request afterwards. Another
        engine with parallel prefill may then start in this process."""
        if self.closed:
            return
        self.closed = True
        for request_id in list(self.requests):
            self.abort_request(request_id)
        if self.parallel_prefill is not None:
            self.parallel_prefill.close()
        if self.prompt_cache.store.files is not None:  # modules encoded so far are on disk when close returns
            self.prompt_cache.store.files.close()
        self.runner.cache.close()
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()
            torch.set_num_threads(self._threads_before)

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
        if self.tensor_parallel is not None:
            self.tensor_parallel.check()  # a lost rank: refuse now rather than fail at the next step
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
        if (policy := self.policy_for(params)).head_budgets:
            raise ValueError(HEAD_BUDGETS_AND_MODULES.format(name=policy.name))
        if params.prompt_logprobs is not None or score_from:
            raise ValueError("prompt_logprobs need every prompt position's logits; a PML prompt computes only its "
                             "uncached tokens (send the prompt as plain text to score it)")  # fmt: skip
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
        seq = self._new_sequence(ids, len(ids), params, seed_offset=0)
        cached = {"cache_salt": salt} if prepared is None else {
            "prompt_positions": tuple(prepared.positions), "prompt_cache": prepared.cached, "cache_salt": prepared.salt,
            "arrival_time": arrival,
        }  # fmt: skip
        request = Request(request_id, text, ids, params, [seq], kv_policy=policy, score_from=score_from, **cached)
        if params.guided_decoding is not None:
            request.grammar = self.compile_grammar(params.guided_decoding)
            seq.matcher = self._grammar_cache.new_matcher(request.grammar)
        if prepared is not None:
            self._pinned_modules[request_id] = prepared.modules
        eos = () if params.ignore_eos else self.tokenizer.eos_token_ids
        request.stop_token_ids = frozenset((*params.stop_token_ids, *eos))
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(ids)
            request.prompt_token_ranks = [None] * len(ids)
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
        if self._grammar_cache is None:
            with extra_imports("structured", "guided decoding"):
                from kvserve.structured.grammars import GrammarCache

            self._grammar_cache = GrammarCache(self.tokenizer, self.loaded.config.vocab_size)
        try:
            return self._grammar_cache.compile(guided)
        except RuntimeError as exc:
            raise ValueError(f"{guided.kind} cannot be compiled for this tokenizer: {exc}") from None

    def _new_sequence(self, ids: list[int], num_prompt: int, params: SamplingParams, seed_offset: int) -> Sequence:
        child = params if params.seed is None else _with_seed(params, params.seed + seed_offset)
        return Sequence(
            seq_id=next(self._seq_ids),
            token_ids=list(ids),
            num_prompt_tokens=num_prompt,
            generator=make_generator(child),  # sampling runs on the logits' CPU copy (runner.py), on any device
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens),
        )

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
        rows_from = self._prompt_logprob_rows(out)
        try:
            result = self.runner.execute(out, rows_from)
        except KVTierError as error:
            return [self._finish_or_report(request) for request in touched.values()] + self._tier_fault(out, error)
        for seq_id in self.scheduler.update(out, result.report):
            self.prompt_cache.store.finish_encoding(self._encodings.pop(seq_id))
        sampled: dict[str, list[tuple[Sequence, torch.Tensor]]] = {}
        for s in out.scheduled:
            if s.seq_id not in self._seqs:  # a module's encoding: nothing to report
                continue
            request, seq = self._seqs[s.seq_id]
            touched[request.request_id] = request
            logits = result.logits[result.rows[s.seq_id]] if result.logits is not None else None
            if s.seq_id in rows_from:
                first = rows_from[s.seq_id]
                self._record_prompt_logprobs(request, s.num_computed_tokens + first, s.token_ids[first:], logits)
            if s.samples:
                sampled.setdefault(request.request_id, []).append((seq, logits[-1]))
        self._sample(sampled)
        return [self._finish_or_report(request) for request in touched.values()]

    def _tier_fault(self, out: SchedulerOutput, error: KVTierError) -> list[RequestOutput]:
        """A KV tier failed a transfer in step ``out``, which is given up. Only the requests it touched (run,
        swapped out or in) are affected: each computes again from its tokens (exact, as preemption by recompute
        is); one that faults a second time ends with finish_reason "error". The others are served as before."""
        if any(s.seq_id not in self._seqs for s in out.scheduled):
            raise error  # a Prompt Cache module's encoding ran in the step: no request owns it to recompute
        self.runner.cache.recover()
        affected = {self._seqs[s.seq_id][0].request_id: self._seqs[s.seq_id][0] for s in out.scheduled}
        for request_id in out.preempted:  # swapped out in the step: the host copy may be incomplete
            request = self.requests.get(request_id)
            if request is not None and request.status == RequestStatus.SWAPPED:
                affected[request_id] = request
        error.request_ids = tuple(request_id for request_id in affected if request_id in self._tier_faulted)
        get_logger().warning(
            "%s; recomputing %d requests, failing %d",
            error,
            len(affected) - len(error.request_ids),
            len(error.request_ids),
        )
        outputs = []
        for request in affected.values():
            if request.request_id in error.request_ids:
                for seq in request.live_seqs:
                    seq.finish_reason = "error"
                self._release(request)
                outputs.append(dataclasses.replace(self._output(request), error=str(error)))
            else:
                self._tier_faulted.add(request.request_id)
                self.scheduler.recompute(request)
        self.kv.pool.forget_free()  # a block the step wrote (or swapped in) may hold a failed copy: no prefix hits
        return outputs

    def _prompt_logprob_rows(self, out: SchedulerOutput) -> dict[int, int]:
        """seq_id -> the first row of its chunk whose logits prompt logprobs need (from there on)."""
        rows = {}
        for s in out.scheduled:
            if s.seq_id not in self._seqs:  # a module's encoding
                continue
            request, seq = self._seqs[s.seq_id]
            if request.prompt_logprobs is None or s.num_computed_tokens >= seq.num_prompt_tokens:
                continue
            first = max(0, request.score_from - 1 - s.num_computed_tokens)  # row p predicts token p + 1
            if first < len(s.token_ids):
                rows[s.seq_id] = first
        return rows

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

    def _sample(self, sampled: dict[str, list[tuple[Sequence, torch.Tensor]]]) -> None:
        rows: list[tuple[Request, Sequence]] = []
        logits: list[torch.Tensor] = []
        for request_id, items in sampled.items():
            request = self.requests[request_id]
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
        sample = sample_each if self.config.batch_invariant else sample_batch
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

    def _fork_for_best_of(self, request: Request, seq: Sequence) -> list[Sequence]:
        """After the prompt, one sequence becomes best_of sequences sharing its blocks."""
        if not request.prefilling or request.params.best_of == 1:
            return [seq]
        for i in range(1, request.params.best_of):
            child = self._new_sequence(seq.token_ids, seq.num_prompt_tokens, request.params, seed_offset=i)
            child.num_computed_tokens = seq.num_computed_tokens
            child.group_slots, child.group_heads = list(seq.group_slots), list(seq.group_heads)
            child.matcher = self._grammar_cache.new_matcher(request.grammar) if request.grammar is not None else None
            self.scheduler.fork(seq, child)
            request.seqs.append(child)
            self._seqs[child.seq_id] = (request, child)
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
                child = self._new_sequence(parent.token_ids, parent.num_prompt_tokens, params, 0)
                _copy_progress(parent, child)
                self.scheduler.fork(parent, child)
                request.seqs.append(child)
                self._seqs[child.seq_id] = (request, child)
                beam = child
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
        finished_scores = [self._beam_score(request, s) for s in request.finished_beams]
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
        done = self._new_sequence(parent.token_ids, parent.num_prompt_tokens, request.params, 0)
        _copy_progress(parent, done)
        done.token_ids.append(cand.token_id)
        done.cumulative_logprob += cand.logprob
        done.finish_reason, done.stop_reason = "stop", cand.token_id
        request.finished_beams.append(done)

    def _beam_score(self, request: Request, seq: Sequence) -> float:
        return beam_search.beam_score(seq.cumulative_logprob, len(seq.output_token_ids), request.params.length_penalty)

    # ----- per-token bookkeeping -----

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

    def _finish_or_report(self, request: Request) -> RequestOutput:
        for seq in request.seqs:
            if seq.finished and seq.seq_id in self.kv:
                self.scheduler.free_sequence(seq)
        if not request.live_seqs:
            self._release(request)
        return self._output(request)

    def _release(self, request: Request) -> None:
        self.scheduler.finish(request)
        self.requests.pop(request.request_id, None)
        for seq in request.seqs:
            self._seqs.pop(seq.seq_id, None)
        self._pending_beams.pop(request.request_id, None)
        self._tier_faulted.discard(request.request_id)
        self.prompt_cache.release(self._pinned_modules.pop(request.request_id, []))
        request.finish_time = time.monotonic()

    def _output(self, request: Request) -> RequestOutput:
        params = request.params
        finished = request.finished
        if params.use_beam_search:
            pool = request.finished_beams if finished else request.live_seqs
            chosen = sorted(pool, key=lambda s: self._beam_score(request, s), reverse=True)[: params.n]
        elif finished and params.best_of > params.n:
            chosen = sorted(request.seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
        else:
            chosen = request.seqs[: params.n]
        outputs = [self._completion(i, seq, params, finished) for i, seq in enumerate(chosen)]
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

    @staticmethod
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


_ENCODE_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)  # a module's encoding samples nothing


def _banned(request: Request, seq: Sequence) -> tuple[int, ...]:
    """The stop tokens while a sequence is shorter than min_tokens: it must not end yet."""
    return tuple(request.stop_token_ids) if len(seq.output_token_ids) < request.params.min_tokens else ()


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(params, seed=seed)


def _copy_progress(parent: Sequence, child: Sequence) -> None:
    child.token_ids = list(parent.token_ids)
    child.num_computed_tokens = parent.num_computed_tokens
    child.group_slots, child.group_heads = list(parent.group_slots), list(parent.group_heads)
    child.cumulative_logprob = parent.cumulative_logprob
    child.logprobs = list(parent.logprobs)
    child.text = parent.text
    child.emitted_chars = parent.emitted_chars
