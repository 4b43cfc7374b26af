"""Every pair of kvserve's techniques on a tiny random checkpoint (float32): a lossless pair generates exactly
what its single-technique reference does, a lossy pair generates well-formed output and reports what it
saved, and a pair that cannot mean anything is refused with the technical reason (README: Composing the
techniques).

Techniques: Prompt Cache (a schema of two modules), compression (PyramidInfer, H2O), offloading (fetch
everything, INT4, InfiniGen; host and disk tiers), KV-Runahead (``prefill_parallel=2``, worker processes),
and the paged cache's own: prefix caching, preemption by swap and by recompute, n > 1.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve import LLM
from kvserve.config import EngineConfig
from kvserve.sampling.sampling_params import SamplingParams
from tests.composition.conftest import BLOCK, GREEDY, PML, SCHEMA, make_engine, prompt_ids, run, tokens
from tests.tiny_models import torch_single_thread  # noqa: F401 - autouse fixture

OFFLOAD_FULL = {"kv_offload": "host", "kv_policy": "full"}


def _prompt_cache_tokens(loaded, repeats: int = 1, **options) -> tuple[list[list[int]], list]:
    engine = make_engine(loaded, **options)
    try:
        engine.register_schema(SCHEMA)
        outputs = run(engine, [PML] * repeats)
        return tokens(outputs), outputs
    finally:
        engine.close()


@pytest.fixture(scope="module")
def prompt_cache_reference(loaded) -> list[int]:
    """Prompt Cache alone, on the paged cache."""
    return _prompt_cache_tokens(loaded)[0][0]


# ----- lossless pairs: token-identical to the single-technique reference -----


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_prompt_cache_with_offloaded_kv_equals_prompt_cache_alone(loaded, prompt_cache_reference, tier) -> None:
    got, outputs = _prompt_cache_tokens(loaded, kv_offload=tier, kv_policy="full")
    assert got == [prompt_cache_reference]
    assert outputs[0].num_cached_tokens > 0  # the modules were imported, not recomputed


def test_prompt_cache_offload_prefix_hits_and_concurrent_imports(loaded, prompt_cache_reference) -> None:
    """Three requests import the same modules at once from the offloaded pool (shared blocks, tails copied in
    the tier), and later ones also hit the prefix cache past the modules."""
    got, outputs = _prompt_cache_tokens(loaded, repeats=3, **OFFLOAD_FULL)
    assert got == [prompt_cache_reference] * 3
    assert outputs[2].num_cached_tokens >= outputs[0].num_cached_tokens


def test_prompt_cache_offload_preempted_by_recompute(loaded, folder) -> None:
    """A pool too small for every request at once: requests are preempted and recomputed, modules stay pinned."""
    roomy = make_engine(loaded, **OFFLOAD_FULL)
    roomy.register_schema(SCHEMA)
    prompts = [PML.replace("so what", f"so {w}") for w in ("what", "where", "why", "who")]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = tokens(run(roomy, prompts, params))
    roomy.close()
    tight = make_engine(loaded, kv_cache_memory=roomy.kv_block_bytes * 48, **OFFLOAD_FULL)
    tight.register_schema(SCHEMA)
    assert tokens(run(tight, prompts, params)) == expected
    assert tight.scheduler.num_preemptions > 0
    tight.close()


def test_offload_prefix_hit_on_blocks_computed_in_the_same_step(loaded) -> None:
    """Identical prompts arriving together: the later ones hit the first one's blocks, registered once its step
    has run (an offloaded cache fetches a decode's rows before the layer that writes them)."""
    ids = prompt_ids(33, seed=1)
    paged = make_engine(loaded)
    expected = tokens(run(paged, [ids] * 3))
    offloaded = make_engine(loaded, **OFFLOAD_FULL)
    outputs = run(offloaded, [ids] * 3)
    later = run(offloaded, [ids])  # the blocks are findable once their step has run
    offloaded.close()
    assert tokens(outputs + later) == expected + expected[:1]
    assert later[0].num_cached_tokens == 32


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "int4"])
def test_parallel_prefill_into_an_offloaded_cache_equals_single_process(folder, policy) -> None:
    """KV-Runahead's KV lands in the host tier (INT4-coded for int4); decoding fetches it as usual."""
    ids = prompt_ids(75, seed=4)
    options = {"model": str(folder), "dtype": "float32", "kv_offload": "host", "kv_policy": policy}
    with LLM(**options) as single:
        expected = single.generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(prefill_parallel=2, prefill_partition="even", **options) as parallel:
        got = parallel.generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert parallel.engine.parallel_prefill.last_route.processes == 2  # it did run over two processes
        assert parallel.engine.runner.cache.bytes_moved()["stored"] > 0
    assert got == expected


@pytest.mark.parametrize(
    ("policy", "tier"), [("pyramid", "host"), ("h2o", "disk"), ("local", "disk"), ("snapkv", "host")]
)
def test_compressed_kv_in_an_offloaded_tier_equals_it_on_the_device(loaded, policy, tier) -> None:
    """PyramidInfer/H2O/local x offload: the per-layer slab lives in the host or disk tier and each layer reads
    its kept slots from there; the same tokens as on the device, with fewer bytes than the full cache's."""
    prompts = [prompt_ids(41, seed=s) for s in range(3)]
    options = {"kv_policy": policy, "kv_budget": 0.5}
    on_device = make_engine(loaded, **options)
    expected = tokens(run(on_device, prompts))
    on_device.close()
    offloaded = make_engine(loaded, kv_offload=tier, **options)
    assert tokens(run(offloaded, prompts)) == expected
    moved = offloaded.runner.cache.bytes_moved()
    offloaded.close()
    full = make_engine(loaded, kv_offload=tier, kv_policy="full")
    run(full, prompts)
    full_moved = full.runner.cache.bytes_moved()
    full.close()
    assert 0 < moved["fetched"] < full_moved["fetched"]  # the policy's compression spares transfers


def test_compressed_offload_preempted_by_recompute(loaded) -> None:
    """A pool too small for every request at once: preempted requests are recomputed from the tier's engine as on
    the device (a recomputed lossy cache is not the one decoding built, so the reference is preempted too)."""
    prompts = [prompt_ids(30, seed=s) for s in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    options = {"kv_policy": "h2o", "kv_budget": 0.5}
    results = []
    for tier in ("none", "host"):
        engine = make_engine(loaded, kv_offload=tier, **options)
        engine.close()
        tight = make_engine(loaded, kv_offload=tier, kv_cache_memory=engine.kv_block_bytes * 100, **options)
        results.append(tokens(run(tight, prompts, params)))
        assert tight.scheduler.num_preemptions > 0
        tight.close()
    assert results[0] == results[1]


@pytest.mark.slow
def test_parallel_prefill_of_compressed_kv_into_the_disk_tier(folder) -> None:
    """KV-Runahead x H2O x offload: the ranks' votes choose the slots, stored in the tier."""
    ids = prompt_ids(75, seed=4)
    options = {"model": str(folder), "dtype": "float32", "block_size": BLOCK, "kv_policy": "h2o", "kv_budget": 0.5}
    with LLM(**options) as single:
        expected = single.generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(prefill_parallel=2, prefill_partition="even", kv_offload="disk", **options) as parallel:
        got = parallel.generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert parallel.engine.parallel_prefill.last_route.processes == 2
        assert parallel.engine.runner.cache.bytes_moved()["stored"] > 0
    assert got == expected


RUNAHEAD_COMPRESSION = {
    "h2o": ({"kv_policy": "h2o", "kv_budget": 0.5}, "even"),
    "h2o tsp": ({"kv_policy": "h2o", "kv_budget": 0.5}, "tsp"),
    "pyramid": ({"kv_policy": "pyramid", "kv_budget": 0.8, "recent_ratio": 0.6}, "even"),  # S_r spans both ranks
    "local": ({"kv_policy": "local", "kv_budget": 0.5}, "even"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(RUNAHEAD_COMPRESSION))
def test_parallel_prefill_with_compression_keeps_what_one_process_keeps(folder, case) -> None:
    """KV-Runahead x PyramidInfer/H2O/local: each rank scores the keys with its own voting queries, the last adds
    the scores up and the cache keeps the policy's choice of each layer's slots. Token-identical to one process
    computing every row of the prompt (PyramidInfer with drops_rows=False: a parallel prefill cannot know which
    rows a layer drops before the last rank's queries vote), and as compressed."""
    policy_options, partition = RUNAHEAD_COMPRESSION[case]
    ids = prompt_ids(75, seed=4)
    options = {"model": str(folder), "dtype": "float32", "block_size": BLOCK, **policy_options}
    with LLM(**options) as single:
        plan = single.engine.plan
        if plan.policy.drops_rows:
            single.engine.plan = dataclasses.replace(plan, policy=dataclasses.replace(plan.policy, drops_rows=False))
        expected, expected_slots = _tokens_and_prompt_slots(single, ids)
    with LLM(prefill_parallel=2, prefill_partition=partition, **options) as parallel:
        got, slots = _tokens_and_prompt_slots(parallel, ids)
        assert parallel.engine.parallel_prefill.last_route.processes == 2
    assert got == expected
    assert slots == expected_slots and min(slots) < len(ids)  # compressed, as in one process


def _tokens_and_prompt_slots(llm: LLM, ids: list[int]) -> tuple[list[int], tuple[int, ...]]:
    """Greedy tokens, and the slots each layer kept after the prompt's step (its StepReport)."""
    reports = []
    report = llm.engine.runner.cache.report

    def spy(metadata):
        reports.append(report(metadata))
        return reports[-1]

    llm.engine.runner.cache.report = spy
    out = llm.generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    (slots,) = reports[0].group_slots.values()
    return out, slots


DOC_SCHEMA = (
    '<schema name="book"><module name="doc">one two three four five six seven eight nine ten eleven twelve '
    "thirteen fourteen fifteen sixteen seventeen eighteen nineteen twenty</module></schema>"
)
DOC_PML = '<prompt schema="book"><doc/> and after that comes</prompt>'


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["none", "host"])
def test_a_module_encoded_by_parallel_prefill_equals_prompt_cache_alone(folder, offload) -> None:
    """KV-Runahead x Prompt Cache: a module's encoding is a scheduled prefill, so a long one (alone in its step)
    runs over the prefill group, at its schema positions (and into an offloaded pool)."""
    # A template that opens with no BOS leaves the schema no text of its own: the module is alone in its step.
    options = {"model": str(folder), "dtype": "float32", "block_size": 4, "kv_offload": offload,
               "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}  # fmt: skip
    with LLM(**options) as single:
        single.register_schema(DOC_SCHEMA)
        expected = single.generate(DOC_PML, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(prefill_parallel=2, prefill_partition="even", **options) as llm:
        routes = []
        run_prefill = llm.engine.parallel_prefill.run

        def spy(token_ids, sink, positions=(), policy=None):
            hidden = run_prefill(token_ids, sink, positions, policy)
            routes.append((len(token_ids), tuple(positions), llm.engine.parallel_prefill.last_route.processes))
            return hidden

        llm.engine.parallel_prefill.run = spy
        info = llm.register_schema(DOC_SCHEMA)
        got = llm.generate(DOC_PML, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    doc = info["modules"]["doc"]
    assert doc["cached"] and doc["tokens"] >= 32
    # Encoded over two processes, at its schema positions.
    assert routes[0] == (doc["tokens"], tuple(range(doc["start"], doc["start"] + doc["tokens"])), 2)
    assert got == expected


def test_prompt_cache_with_h2o_at_full_budget_equals_prompt_cache_alone(loaded) -> None:
    """Prompt Cache x compression, its plumbing exact: at budget 1 H2O keeps every slot, so modules imported
    layer by layer (full blocks shared per layer, tails copied per layer) give Prompt Cache's tokens (with
    modules encoded alone: a compressing policy does not encode them after the schema's prefix)."""
    prompt_cache_reference = _prompt_cache_tokens(loaded, prompt_cache_context="none")[0][0]
    got, outputs = _prompt_cache_tokens(loaded, repeats=2, kv_policy="h2o", kv_budget=1.0)
    assert got == [prompt_cache_reference] * 2
    assert outputs[0].num_cached_tokens > 0
    offloaded, _ = _prompt_cache_tokens(loaded, kv_policy="h2o", kv_budget=1.0, kv_offload="disk")
    assert offloaded == [prompt_cache_reference]  # and with the per-layer slab in the disk tier


@pytest.mark.parametrize("policy", ["pyramid", "h2o", "local", "snapkv", "pyramidkv"])
def test_prompt_cache_stores_modules_compressed_and_never_rewrites_them(loaded, policy) -> None:
    """Prompt Cache x PyramidInfer/H2O/local: a module is encoded under the policy, so each layer keeps its own
    share of it (less memory per cached module); requests import those slots and compress only their own."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    full = make_engine(loaded, block_size=2)
    full.register_schema(SCHEMA)
    full.encode_modules()
    full_bytes = full.prompt_cache.store.memory_bytes()
    full.close()
    engine = make_engine(loaded, kv_policy=policy, kv_budget=0.5, block_size=2)
    engine.register_schema(SCHEMA)
    engine.encode_modules()
    store, cache = engine.prompt_cache.store, engine.runner.cache
    assert 0 < store.memory_bytes() < full_bytes
    modules = list(store.modules.values())
    blocks = [b for m in modules for b in engine.kv.held_blocks(m.seq_id)]
    before = cache.k[0, blocks].clone()
    outputs = run(engine, [PML, PML.replace("so what", "and why")], params)
    assert all(len(o.outputs[0].token_ids) == 24 and o.num_cached_tokens > 0 for o in outputs)
    assert torch.equal(cache.k[0, blocks], before)  # shared module slots are never compacted
    engine.close()


def test_prompt_cache_with_pyramid_keeps_the_recent_window_after_the_modules(loaded) -> None:
    """The imported module slots are compressed already; the prompt's own slots after them get PyramidInfer's
    share of the whole sequence, so at every layer they keep at least its recent window S_r (the question after
    a document, as without modules), not a few slots."""
    question = "so what comes next in the list of all the colours and all the numbers named above, tell me now"
    engine = make_engine(loaded, kv_policy="pyramid", kv_budget=0.5)
    engine.register_schema(SCHEMA)
    engine.encode_modules()
    steps = []
    execute = engine.runner.execute

    def spy(out, rows_from=None):
        result = execute(out, rows_from)
        steps.extend((s, result.report.group_slots.get(s.seq_id)) for s in out.scheduled if s.seq_id >= 0)
        return result

    engine.runner.execute = spy
    run(engine, [PML.replace("so what comes next in the list", question)])
    engine.close()
    first, kept = steps[0]
    assert first.num_computed_tokens > 0 and min(first.group_frozen) > 0  # the modules were imported per layer
    recent = first.kv_policy.recent_count(first.num_computed_tokens + len(first.token_ids))
    for frozen, held, after in zip(first.group_frozen, first.group_slots, kept, strict=True):
        own = held - frozen + len(first.token_ids)  # copied module tails and the prompt's own tokens
        assert after - frozen >= min(own, recent)


def test_prompt_cache_with_compression_preempted_by_recompute(loaded) -> None:
    prompts = [PML.replace("so what", f"so {w}") for w in ("what", "where", "why", "who")]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    roomy = make_engine(loaded, kv_policy="h2o", kv_budget=1.0)
    roomy.register_schema(SCHEMA)
    expected = tokens(run(roomy, prompts, params))
    roomy.close()
    tight = make_engine(loaded, kv_policy="h2o", kv_budget=1.0, kv_cache_memory=roomy.kv_block_bytes * 180)
    tight.register_schema(SCHEMA)
    assert tokens(run(tight, prompts, params)) == expected
    assert tight.scheduler.num_preemptions > 0
    tight.close()


# ----- lossy pairs: well-formed, and what they save measured -----


def test_prompt_cache_with_infinigen_fetches_fewer_rows(loaded, prompt_cache_reference) -> None:
    engine = make_engine(loaded, kv_offload="host", kv_policy="infinigen", infinigen_alpha=0.5)
    engine.register_schema(SCHEMA)
    (out,) = run(engine, [PML])
    cache = engine.runner.cache
    engine.close()
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens and out.num_cached_tokens > 0
    assert all(0 <= t < loaded.config.vocab_size for t in out.outputs[0].token_ids)
    assert min(cache.stats.fetch_fraction()[1:]) < 1  # past layer 0 it read fewer rows than it holds


@pytest.mark.slow
def test_parallel_prefill_with_infinigen_generates_well_formed_output(folder) -> None:
    ids = prompt_ids(70, seed=6)
    options = {"model": str(folder), "dtype": "float32", "kv_offload": "host", "kv_policy": "infinigen"}
    with LLM(prefill_parallel=2, prefill_partition="even", infinigen_alpha=0.5, **options) as llm:
        out = llm.generate(ids, GREEDY, use_tqdm=False)[0]
        assert llm.engine.parallel_prefill.last_route.processes == 2
        fractions = llm.engine.runner.cache.stats.fetch_fraction()
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    assert min(fractions[1:]) < 1  # the partial keys the parallel prefill stored drive the selection


# ----- refused pairs: the reason, in the error -----

REFUSED = {
    "prompt cache (host tier) x pyramid": (
        {"kv_policy": "pyramid", "prompt_cache_tier": "host"}, True, "copies a module's tokens across every layer",
    ),
    "prompt cache (host tier) x offload": (
        {"kv_offload": "host", "prompt_cache_tier": "host"}, True, "would copy them into it a second time",
    ),
    "prompt cache x infinigen pool limit": (
        {"kv_offload": "host", "kv_policy": "infinigen", "kv_pool_limit": 0.5}, True, "overwrites a sequence's slots",
    ),
    "runahead x infinigen pool limit": (
        {"kv_offload": "host", "kv_policy": "infinigen", "kv_pool_limit": 0.5, "prefill_parallel": 2}, False,
        "which a parallel prefill does not run",
    ),
    "swap preemption x offload": (
        {"kv_offload": "host", "preemption_mode": "swap"}, False, "its KV is already off the device",
    ),
    "prompt cache x adakv": ({"kv_policy": "adakv"}, True, "packs a layer's KV heads into its slots"),
    "tensor parallel x adakv": (
        {"kv_policy": "adakv", "tensor_parallel_size": 2}, False, "allocates a layer's budget across its KV heads",
    ),
}  # fmt: skip


@pytest.mark.parametrize("pair", sorted(REFUSED))
def test_a_pair_that_cannot_compose_is_refused_with_its_reason(loaded, pair) -> None:
    options, at_schema, reason = REFUSED[pair]
    if not at_schema:
        with pytest.raises(ValueError, match=reason):
            EngineConfig(model=str(loaded.path), **options)
        return
    engine = make_engine(loaded, **options)
    try:
        with pytest.raises(ValueError, match=reason):
            engine.register_schema(SCHEMA)
        assert tokens(run(engine, [prompt_ids(9)]))[0]  # the engine still serves plain prompts
    finally:
        engine.close()


def test_a_request_with_head_budgets_cannot_import_modules(loaded) -> None:
    engine = make_engine(loaded, kv_policy="snapkv")
    engine.register_schema(SCHEMA)
    try:
        with pytest.raises(ValueError, match="kv_policy='adakv' packs a layer's KV heads"):
            engine.add_request(PML, dataclasses.replace(GREEDY, kv_policy="adakv"))
        assert tokens(run(engine, [PML]))[0]  # the engine still serves the schema's prompts with its own policy
    finally:
        engine.close()


def test_compression_refuses_samples_that_would_share_compacted_blocks(loaded) -> None:
    engine = make_engine(loaded, kv_policy="h2o")
    with pytest.raises(ValueError, match="samples cannot share them"):
        engine.add_request(prompt_ids(9), SamplingParams(n=2, max_tokens=2))
    engine.close()
