"""The engine on a CUDA GPU against the same engine on the CPU, float32, tiny random checkpoints: every cache
kind (paged, prefix hits, chunked prefill, preemption by swap through pinned host memory and by recompute,
compressed policies, offloaded host tier with InfiniGen, INT4, sliding windows, Prompt Cache on both tiers and
with selective recompute) generates the same greedy tokens with the same logprobs. bfloat16 (what `dtype auto`
picks on CUDA) stays close to float32; a seed samples what it samples on the CPU. The real default model on
CUDA matches Hugging Face transformers on the CPU.

These tests need a CUDA GPU: they are skipped without one and run wherever one is (the README's "CUDA"
section has the command)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.core.outputs import RequestOutput
from kvserve.kv.tiers import TransferQueue, scatter_rows
from kvserve.sampling.sampling_params import SamplingParams
from tests.tiny_models import TinySpec, skewing_in_tmp, write_tiny_model  # noqa: F401 - autouse fixture

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SPEC = TinySpec(num_heads=4, num_kv_heads=2, num_layers=4, head_dim=64, max_position_embeddings=512, seed=31)
GEMMA = TinySpec(
    arch="gemma3", num_heads=4, num_kv_heads=2, head_dim=16, num_layers=6, tie_word_embeddings=True,
    extra={"sliding_window": 8, "query_pre_attn_scalar": 16, "hidden_activation": "gelu_pytorch_tanh"},
)  # fmt: skip
BLOCK = 4
LENGTHS = (30, 57, 9, 2)
MAX_TOKENS = 12
SHARED = list(range(40, 80))  # 40 tokens two prompts share: ten whole blocks for the prefix cache


def prompt_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 290, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [prompt_ids(n, seed=n) for n in LENGTHS] + [SHARED + prompt_ids(5, 1), SHARED + prompt_ids(7, 2)]


@pytest.fixture(scope="module", autouse=True)
def float32_matmuls():
    """TF32 would round float32 products to 10 mantissa bits: the CPU comparison needs real float32."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("cuda"), SPEC)


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("cuda-gemma"), GEMMA)


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)


def make_engine(folder: Path, device: str, dtype: str = "float32", **options) -> LLMEngine:
    options = {"kv_cache_memory": "8MiB", "swap_space": 0, **options}
    return LLMEngine(EngineConfig(model=str(folder), dtype=dtype, device=device, block_size=BLOCK, **options))


def run(engine: LLMEngine, prompts, params: SamplingParams) -> list[RequestOutput]:
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, RequestOutput] = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        done.update({out.request_id: out for out in engine.step() if out.finished})
    assert not engine.has_unfinished_requests()
    engine.close()
    return [done[i] for i in ids]


def chosen_logprobs(out: RequestOutput) -> list[float]:
    completion = out.outputs[0]
    return [step[token] for step, token in zip(completion.logprobs, completion.token_ids, strict=True)]


def assert_same_generations(cpu: list[RequestOutput], gpu: list[RequestOutput], atol: float = 2e-3) -> None:
    for a, b in zip(cpu, gpu, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert chosen_logprobs(b) == pytest.approx(chosen_logprobs(a), abs=atol)


def block_bytes(num_layers: int = SPEC.num_layers) -> int:
    return num_layers * 2 * SPEC.num_kv_heads * SPEC.head_dim * 4 * BLOCK  # K and V, float32


SCENARIOS = {
    "paged": {},
    "pyramidkv": {"kv_policy": "pyramidkv", "kv_budget": 0.5},
    "chunked-prefill": {"max_num_batched_tokens": 16},
    # 14 blocks hold 56 tokens: the 57-token prompt alone does not fit beside anything else.
    "swap-preemption": {
        "kv_cache_memory": 24 * block_bytes() + block_bytes() - 1, "swap_space": 64 * block_bytes(),
        "preemption_mode": "swap", "max_num_seqs": 6,
    },
    "recompute-preemption": {"kv_cache_memory": 24 * block_bytes() + block_bytes() - 1, "max_num_seqs": 6},
    "pyramid": {"kv_policy": "pyramid", "kv_budget": 0.5},
    "h2o": {"kv_policy": "h2o", "kv_budget": 0.5},
    "snapkv": {"kv_policy": "snapkv", "kv_budget": 0.5},
    "adakv": {"kv_policy": "adakv", "kv_budget": 0.5},
    "local": {"kv_policy": "local", "kv_budget": 0.5},
    "int4": {"kv_policy": "int4", "kv_offload": "host"},
    "offload-host": {"kv_offload": "host"},
    "infinigen": {"kv_policy": "infinigen", "kv_offload": "host"},
}  # fmt: skip


@pytest.mark.parametrize("options", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_cuda_generates_what_the_cpu_does(folder, options) -> None:
    cpu = run(make_engine(folder, "cpu", **options), PROMPTS, greedy())
    gpu_engine = make_engine(folder, "cuda", **options)
    assert next(gpu_engine.loaded.model.parameters()).is_cuda
    gpu = run(gpu_engine, PROMPTS, greedy())
    assert_same_generations(cpu, gpu)
    if options.get("kv_policy", "full") == "full" and "kv_offload" not in options:
        assert gpu[-1].num_cached_tokens == cpu[-1].num_cached_tokens > 0  # the shared prefix hit on both


def test_swap_preemption_on_cuda_moves_blocks_through_the_host_tier(folder) -> None:
    engine = make_engine(folder, "cuda", **SCENARIOS["swap-preemption"])
    assert engine.runner.cache.host_cache.k.is_pinned()
    run(engine, PROMPTS, greedy())
    assert engine.scheduler.num_preemptions > 0


def test_a_store_to_the_host_tier_holds_the_rows_the_gpu_just_computed() -> None:
    """The rows come from a long matmul still running when the store is queued on the transfer stream."""
    queue = TransferQueue("cuda")
    host = torch.zeros(4096, 256, pin_memory=True)
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(3):
        rows = (a @ a)[:, :256]
        index = torch.randperm(4096)
        queue.store(lambda rows=rows, index=index: scatter_rows(host, index, rows), rows.numel() * 4).wait()
        torch.cuda.synchronize()
        assert torch.equal(host[index], rows.cpu())


def test_sliding_window_layers_on_cuda(gemma_folder) -> None:
    prompts = PROMPTS[:3]
    cpu = run(make_engine(gemma_folder, "cpu"), prompts, greedy())
    assert_same_generations(cpu, run(make_engine(gemma_folder, "cuda"), prompts, greedy()))


SCHEMA = """<schema name="shop">
  the cat sat on the mat and then it
  <module name="doc">one two three four five six seven eight nine ten eleven twelve</module>
  <module name="greet">good day to <param name="who" len="6"/> and all of you</module>
</schema>"""
PML_PROMPTS = [
    '<prompt schema="shop"><doc/><greet who="the cat"/> so what next</prompt>',
    '<prompt schema="shop"><greet who="a dog"/> and then</prompt>',
]


@pytest.mark.parametrize(
    "options",
    [{}, {"prompt_cache_tier": "host"}, {"prompt_cache_recompute": 0.3}],
    ids=["device-tier", "host-tier", "selective-recompute"],
)
def test_prompt_cache_on_cuda_generates_what_the_cpu_does(folder, options) -> None:
    outputs = {}
    for device in ("cpu", "cuda"):
        engine = make_engine(folder, device, **options)
        engine.register_schema(SCHEMA)
        outputs[device] = run(engine, PML_PROMPTS, greedy())
        assert all(out.num_cached_tokens > 0 for out in outputs[device])
    assert_same_generations(outputs["cpu"], outputs["cuda"])


def test_auto_dtype_on_cuda_is_bfloat16_and_close_to_float32(folder) -> None:
    engine = make_engine(folder, "cuda", dtype="auto")
    assert engine.loaded.dtype == torch.bfloat16
    bf16 = run(engine, PROMPTS, greedy(1))
    fp32 = run(make_engine(folder, "cuda"), PROMPTS, greedy(1))
    # bfloat16 keeps 8 mantissa bits: the first token's logprob within 0.1 (tiny-model logits span units).
    assert [chosen_logprobs(o)[0] for o in bf16] == pytest.approx([chosen_logprobs(o)[0] for o in fp32], abs=0.1)


def test_a_seed_samples_on_cuda_what_it_samples_on_the_cpu(folder) -> None:
    """Sampling draws from the logits' CPU copy with a CPU generator, whatever device the model is on."""
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    cpu, gpu = (run(make_engine(folder, device), PROMPTS[:3], params) for device in ("cpu", "cuda"))
    for a, b in zip(cpu, gpu, strict=True):
        assert [c.token_ids for c in b.outputs] == [c.token_ids for c in a.outputs]
    assert any(c.token_ids != gpu[0].outputs[0].token_ids for c in gpu[0].outputs[1:] + gpu[1].outputs)


@pytest.mark.real_model
def test_default_model_on_cuda_matches_transformers(hf_default_model) -> None:
    engine = LLMEngine(EngineConfig(dtype="float32", device="cuda", kv_cache_memory="256MiB", swap_space=0))
    text = "The capital of France is Paris. The capital of Germany is"
    ids = engine.tokenizer.encode(text)
    (out,) = run(engine, [ids], SamplingParams(temperature=0.0, max_tokens=16, prompt_logprobs=1, logprobs=1))
    with torch.no_grad():
        sequence = torch.tensor([ids + out.outputs[0].token_ids[:-1]])
        reference = torch.log_softmax(hf_default_model(sequence).logits[0].float(), dim=-1)
    generated = reference[len(ids) - 1 :].argmax(dim=-1).tolist()
    assert out.outputs[0].token_ids == generated  # transformers' greedy choice at every generated position
    ours = torch.tensor(chosen_logprobs(out))
    theirs = reference[len(ids) - 1 :].gather(1, torch.tensor(generated)[:, None])[:, 0]
    assert ours.tolist() == pytest.approx(theirs.tolist(), abs=2e-3)
