"""InfiniGen's offline skewing: orthogonal matrices that concentrate query/key magnitude in few dimensions.

For each layer and KV head, the queries of its query heads (after rotary embedding) on a sample text
are decomposed, Q = U S V^T, and A = V. Because A is orthogonal, (Q A)(K A)^T = Q K^T: attention is
unchanged, but the skewed queries Q A put most of their magnitude in the first columns, so a few
columns of Q A and K A predict the attention scores well. Those columns are ranked by the column sums
of |Q A| + |K A| on the sample (the authors' partial-weight setup); a run keeps the top
``partial_ratio`` of them.

The same run over the sample calibrates InfiniGen's threshold per layer (``policies/calibration.py``) for the
default partial ratio, and for another one when an engine asks (``infinigen_alpha="auto"``).

``skewing_for`` computes this once per model (for SmolLM2-135M: 37 s on one thread of an AVX2-only CPU,
mostly the sample's forward pass and the calibration; the skewing alone took 2-8 s on 2 AMX threads) and
caches it in ``~/.cache/kvserve/infinigen/`` (``$KVSERVE_INFINIGEN_DIR``), keyed by a hash of the model's
weights; ``kvserve infinigen-setup`` runs it ahead of time.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvserve.attention.backend import AttentionMetadata
from kvserve.attention.contiguous import ContiguousKVCache
from kvserve.log import get_logger
from kvserve.models.llama import LlamaForCausalLM
from kvserve.policies.calibration import SampleRows, ThresholdCalibration, calibrate_alphas, calibration_rows
from kvserve.policies.infinigen import InfiniGen, Rehearsal, activation_dtype_device

SKEWING_DIR_ENV = "KVSERVE_INFINIGEN_DIR"
SAMPLE_TOKENS = 2048
# The sample prose, shipped with kvserve: the first chapter of Jane Austen's Emma (public domain text, the head of
# the evaluation data's austen.txt, from Debian's r-cran-janeaustenr 1.0.0-1); 17,923 characters, 4,560 tokens
# for SmolLM2.
SAMPLE_TEXT = Path(__file__).with_name("skewing_sample.txt")
CALIBRATION_ROWS = 128  # query rows of the sample's second half that calibrate the threshold
_FORMAT = 5  # bump when the cached file's meaning changes (2: per-layer calibrated alphas; 3: sliding windows;
# 4: layer 1's alpha for its own query; 5: window layers' alphas, for their own query at window_mass)


@dataclass(frozen=True)
class Skewing:
    """Per layer and KV head: the skewing matrix and its columns ranked by importance."""

    matrices: torch.Tensor  # (L, Hkv, D, D) float32, orthogonal
    ranking: torch.Tensor  # (L, Hkv, D) long: skewed dimensions, most important first
    target: ThresholdCalibration = ThresholdCalibration()  # what the calibrated alphas keep
    alphas: dict[int, tuple[float, ...]] = field(default_factory=dict)  # partial dims -> each layer's alpha

    def partial(self, num_dims: int) -> torch.Tensor:
        """A restricted to each head's ``num_dims`` most important columns: (L, Hkv, D, r) float32."""
        index = self.ranking[..., :num_dims]  # (L, Hkv, r)
        return self.matrices.gather(-1, index[:, :, None, :].expand(-1, -1, self.matrices.shape[-2], -1))


class _Recorder(ContiguousKVCache):
    """A contiguous cache that also keeps every layer's rotated queries and keys, and at ``rows`` (if given)
    every layer's attention input and the rotary tables, for calibration."""

    def __init__(self, *args, rows: torch.Tensor | None = None, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.queries: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.rows = rows
        self.inputs: dict[int, torch.Tensor] = {}
        self.ropes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> the tables it saw (layer + 1's)

    def observe_input(
        self, layer: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata
    ) -> None:
        if self.rows is not None:
            rows = self.rows.to(x.device)
            self.inputs[layer] = x.index_select(0, rows).cpu()  # (R, hidden), in the model's dtype
            self.ropes[layer] = (rope[0].index_select(0, rows).cpu(), rope[1].index_select(0, rows).cpu())

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        self.queries[layer], self.keys[layer] = q.float().cpu(), k.float().cpu()
        return super().forward(layer, q, k, v, metadata)

    def sample(self) -> SampleRows:
        """The calibration rows' inputs and queries, and every key (needs ``rows``)."""
        layers = range(len(self.keys))
        queries = [self.queries[layer][self.rows] for layer in layers]  # (R, H, D) each
        inputs = [self.inputs[layer] for layer in layers]
        ropes = [self.ropes[layer] for layer in layers]
        return SampleRows(self.rows, inputs, queries, [self.keys[layer] for layer in layers], ropes)


def skew_head(queries: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One KV head: queries (n, D) of its query heads stacked, keys (m, D) -> A (D, D) and its columns
    ranked by |Q A| + |K A| (D,) long."""
    _, _, vh = torch.linalg.svd(queries, full_matrices=False)
    a = vh.transpose(0, 1).contiguous()  # columns: right singular vectors, largest singular value first
    magnitude = (queries @ a).abs().sum(dim=0) + (keys @ a).abs().sum(dim=0)
    return a, magnitude.argsort(descending=True)


@torch.inference_mode()
def record_sample(model: LlamaForCausalLM, token_ids: list[int], rows: torch.Tensor | None = None) -> _Recorder:
    """Run ``token_ids`` through ``model``, recording queries and keys (and the calibration ``rows``' inputs)."""
    cfg = model.config
    dtype, device = activation_dtype_device(model)
    n = len(token_ids)
    recorder = _Recorder(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, n, dtype, device, rows=rows)
    metadata = AttentionMetadata(
        seq_ids=(0,), query_lens=(n,), context_lens=(0,), layer_windows=cfg.layer_windows,
        softcap=cfg.attention_softcap,
    )  # fmt: skip
    model(torch.tensor(token_ids, device=device), torch.arange(n, device=device), recorder, metadata)
    return recorder


def compute_skewing(model: LlamaForCausalLM, token_ids: list[int]) -> Skewing:
    """Run ``token_ids`` through ``model`` and skew every layer's heads (see the module doc); uncalibrated."""
    return skew_recorded(model, record_sample(model, token_ids))


def skew_recorded(model: LlamaForCausalLM, recorder: _Recorder) -> Skewing:
    """Every layer's skewing from the queries and keys a run over the sample recorded."""
    cfg = model.config
    group = cfg.num_heads // cfg.num_kv_heads
    matrices = torch.empty(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim)
    ranking = torch.empty(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=torch.long)
    for layer in range(cfg.num_layers):
        q, k = recorder.queries[layer], recorder.keys[layer]  # (n, H, D), (n, Hkv, D)
        for head in range(cfg.num_kv_heads):
            heads = q[:, head * group : (head + 1) * group].reshape(-1, cfg.head_dim)
            matrices[layer, head], ranking[layer, head] = skew_head(heads, k[:, head])
    return Skewing(matrices, ranking)


def model_fingerprint(path: Path) -> str:
    """sha256 of the model's weight files (a GGUF file, or a folder's safetensors and config)."""
    files = [path] if path.is_file() else sorted([*path.glob("*.safetensors"), *path.glob("config.json")])
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def default_skewing_dir() -> Path:
    override = os.environ.get(SKEWING_DIR_ENV)
    return Path(override).expanduser() if override else Path.home() / ".cache" / "kvserve" / "infinigen"


def sample_tokens(tokenizer, limit: int) -> list[int]:  # noqa: ANN001 - kvserve.text.tokenizer.Tokenizer
    """The first ``limit`` tokens of the sample prose (``SAMPLE_TEXT``)."""
    with open(SAMPLE_TEXT, encoding="utf-8") as f:
        text = f.read(limit * 8)
    return tokenizer.encode(text, add_special_tokens=False)[:limit]


def skewing_for(
    loaded,  # noqa: ANN001 - kvserve.models.LoadedModel
    directory: Path | None = None,
    refresh: bool = False,
    partial_dims: int | None = None,
    target: ThresholdCalibration | None = None,
) -> tuple[Skewing, Path]:
    """The model's skewing, from the cache file if there is one (else computed and saved); and the file.

    ``partial_dims``: also the alphas calibrated for that many partial dimensions (computed and saved if the
    file lacks them); ``target``: what the calibration keeps (None: the file's, else the default). A file of an
    older format (no calibration) is recomputed."""
    directory = directory or default_skewing_dir()
    file = directory / f"{model_fingerprint(Path(loaded.path))[:24]}.pt"
    saved = None if refresh else load_skewing(file)
    if saved is not None and (partial_dims is None or partial_dims in saved.alphas) and target in (None, saved.target):
        return saved, file
    if getattr(loaded, "shard", None) is not None:  # a rank's shard cannot run the sample text alone
        raise ValueError(_setup_needed(file, saved, partial_dims))
    skewing = _compute(loaded, saved, partial_dims, target)
    directory.mkdir(parents=True, exist_ok=True)
    partial = file.with_suffix(f".tmp{os.getpid()}")
    torch.save(_file_contents(skewing), partial)
    partial.replace(file)  # atomic: a concurrent engine never reads half a file
    return skewing, file


def load_skewing(file: Path) -> Skewing | None:
    """The skewing a cache file holds; None if there is none, or it is of another format (an older kvserve's)."""
    if not file.is_file():
        return None
    saved = torch.load(file, weights_only=True)
    if saved.get("format") != _FORMAT:
        return None
    calibration = saved["calibration"]
    target = ThresholdCalibration(calibration["mass"], calibration["quantile"], calibration["window_mass"])
    alphas = {int(dims): tuple(float(a) for a in values) for dims, values in calibration["alphas"].items()}
    return Skewing(saved["matrices"], saved["ranking"], target, alphas)


def _file_contents(skewing: Skewing) -> dict:
    target = skewing.target
    calibration = {"mass": target.mass, "quantile": target.quantile, "window_mass": target.window_mass,
                   "alphas": {dims: list(values) for dims, values in skewing.alphas.items()}}  # fmt: skip
    return {"format": _FORMAT, "matrices": skewing.matrices, "ranking": skewing.ranking, "calibration": calibration}


def _setup_needed(file: Path, saved: Skewing | None, partial_dims: int | None) -> str:
    """Why a tensor-parallel rank cannot use the skewing file, and the command that makes it."""
    if saved is None:
        return (
            f"InfiniGen under tensor parallelism reads the model's skewing from {file}, which is not there yet (or "
            "is from an older kvserve, without calibrated alphas): run `kvserve infinigen-setup` for this model "
            "once (one process) first"
        )
    return (
        f"InfiniGen under tensor parallelism reads infinigen_alpha='auto' from {file}, which has calibrated alphas "
        f"for {sorted(saved.alphas)} partial dimensions, not {partial_dims}: run `kvserve infinigen-setup "
        "--partial-ratio <your infinigen_partial_ratio>` for this model once (one process), or give infinigen_alpha "
        "a number"
    )


def _compute(loaded, saved: Skewing | None, partial_dims: int | None, target: ThresholdCalibration | None) -> Skewing:  # noqa: ANN001
    """The skewing (``saved``'s matrices if there are) calibrated for the default and ``partial_dims`` dimensions."""
    cfg = loaded.config
    limit = min(SAMPLE_TOKENS, cfg.max_position_embeddings)
    ids = sample_tokens(loaded.tokenizer, limit)
    get_logger().info("InfiniGen setup: skewing and calibrating %d layers on %d tokens of sample text",
                      cfg.num_layers, len(ids))  # fmt: skip
    recorder = record_sample(loaded.model, ids, calibration_rows(len(ids), CALIBRATION_ROWS))
    skewing = saved if saved is not None else skew_recorded(loaded.model, recorder)
    target = target or skewing.target
    alphas = dict(skewing.alphas) if target == skewing.target else {}
    wanted = {InfiniGen().partial_dims(cfg.head_dim)} | ({partial_dims} if partial_dims is not None else set())
    sample = recorder.sample()
    for dims in sorted(wanted - set(alphas)):
        alphas[dims] = calibrate_alphas(sample, Rehearsal(loaded.model, skewing.partial(dims)), target)
    return Skewing(skewing.matrices, skewing.ranking, target, alphas)
