"""Progress with Prompt Cache modules in the pool (tiny random checkpoint): unpinned device-tier modules give
their blocks back to a request that needs them, and module encodings count against ``max_num_seqs``."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.models import LoadedModel, load_model
from kvserve.sampling.sampling_params import SamplingParams
from tests.tiny_models import TinySpec, write_tiny_model

SPEC = TinySpec(num_heads=4, num_kv_heads=2, seed=7)
BLOCK = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
WORDS = "one two three four five six seven eight nine ten".split()
SCHEMA = '<schema name="big">{}</schema>'.format(
    "".join(f'<module name="m{i}">{" ".join(WORDS[i : i + 4])}</module>' for i in range(4))
)
STEP_CAP = 300  # a request that cannot progress fails the test here instead of hanging it


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> LoadedModel:
    folder: Path = write_tiny_model(tmp_path_factory.mktemp("progress"), SPEC)
    return load_model(folder)


def make_engine(loaded: LoadedModel, num_blocks: int, **options) -> LLMEngine:
    small = {"dtype": "float32", "kv_cache_memory": 2**20, "swap_space": 2**18, "block_size": BLOCK}
    block_bytes = LLMEngine(EngineConfig(model=str(loaded.path), **small), loaded=loaded).kv_block_bytes
    options = {**small, "kv_cache_memory": block_bytes * num_blocks, **options}
    return LLMEngine(EngineConfig(model=str(loaded.path), **options), loaded=loaded)


def steps_until_done(engine: LLMEngine) -> int:
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps <= STEP_CAP, "no progress: a request waits forever"
        engine.step()
    return steps


def test_unpinned_device_modules_give_their_blocks_to_a_waiting_request(loaded):
    engine = make_engine(loaded, num_blocks=40)
    engine.register_schema(SCHEMA)
    steps_until_done(engine)  # the encodings
    store = engine.prompt_cache.store
    held = engine.kv.pool.num_blocks - engine.kv.pool.num_free
    assert held >= 15 and all(m.pins == 0 for m in store.modules.values())  # the modules hold ~half the pool
    prompt = [5 + i % 200 for i in range(110)]  # 28 blocks: more than the modules leave free
    assert engine.kv.blocks_for(len(prompt)) > engine.kv.pool.num_free
    request_id = engine.add_request(prompt, GREEDY)
    outputs = []
    for _ in range(STEP_CAP):
        outputs += [out for out in engine.step() if out.finished]
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests(), "no progress: the plain request waits for blocks the modules keep"
    assert [out.request_id for out in outputs] == [request_id] and len(outputs[0].outputs[0].token_ids) == 8
    assert store.stats.evictions >= 1 and engine.kv.pool.num_free == engine.kv.pool.num_blocks - sum(
        len(engine.kv.held_blocks(m.seq_id)) for m in store.modules.values() if m.seq_id is not None
    )
    engine.add_request('<prompt schema="big"><m0/> and so</prompt>', GREEDY)  # an evicted module is encoded again
    steps_until_done(engine)
    assert all(m.pins == 0 for m in store.modules.values())


@pytest.mark.slow
def test_module_encodings_count_against_max_num_seqs(loaded):
    # Modules encoded alone: the store gives each encoding its blocks, and the scheduler starts it without admission.
    engine = make_engine(loaded, num_blocks=200, max_num_seqs=2, prompt_cache_context="none")
    engine.add_request([5 + i for i in range(20)], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    engine.step()
    engine.register_schema(SCHEMA)  # four encodings queued behind a running request
    schedule, widths = engine.scheduler.schedule, []

    def counting_schedule():
        out = schedule()
        widths.append(len(out.scheduled))
        return out

    engine.scheduler.schedule = counting_schedule
    steps_until_done(engine)
    assert max(widths) == 2, f"up to {max(widths)} sequences in a step with max_num_seqs=2"
    assert all(m.encoded for m in engine.prompt_cache.store.modules.values())
