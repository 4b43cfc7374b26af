"""InfiniGen's offline skewing: orthogonal matrices that concentrate query/key magnitude in few dimensions.

For each layer and KV head, the queries of its query heads (after rotary embedding) on a sample text
are decomposed, Q = U S V^T, and A = V. Because A is orthogonal, (Q A)(K A)^T = Q K^T: attention is
unchanged, but the skewed queries Q A put most of their magnitude in the first columns, so a few
columns of Q A and K A predict the attention scores well. Those columns are ranked by the column sums
of |Q A| + |K A| on the sample (the authors' partial-weight setup); a run keeps the top
``partial_ratio`` of them.

``skewing_for`` computes this once per model (2-8 s for SmolLM2-135M on 2 CPU threads, mostly the SVDs)
and caches it in ``~/.cache/kvserve/infinigen/`` (``$KVSERVE_INFINIGEN_DIR``), keyed by a hash of the
model's weights; ``kvserve infinigen-setup`` runs it ahead of time.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.attention.backend import AttentionMetadata
from kvserve.attention.contiguous import ContiguousKVCache
from kvserve.eval.data import AUSTEN, require
from kvserve.log import get_logger
from kvserve.models.llama import LlamaForCausalLM

SKEWING_DIR_ENV = "KVSERVE_INFINIGEN_DIR"
SAMPLE_TOKENS = 2048
_FORMAT = 1  # bump when the cached file's meaning changes


@dataclass(frozen=True)
class Skewing:
    """Per layer and KV head: the skewing matrix and its columns ranked by importance."""

    matrices: torch.Tensor  # (L, Hkv, D, D) float32, orthogonal
    ranking: torch.Tensor  # (L, Hkv, D) long: skewed dimensions, most important first

    def partial(self, num_dims: int) -> torch.Tensor:
        """A restricted to each head's ``num_dims`` most important columns: (L, Hkv, D, r) float32."""
        index = self.ranking[..., :num_dims]  # (L, Hkv, r)
        return self.matrices.gather(-1, index[:, :, None, :].expand(-1, -1, self.matrices.shape[-2], -1))


class _Recorder(ContiguousKVCache):
    """A contiguous cache that also keeps every layer's rotated queries and keys."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - ContiguousKVCache's
        super().__init__(*args, **kwargs)
        self.queries: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        self.queries[layer], self.keys[layer] = q.float().cpu(), k.float().cpu()
        return super().forward(layer, q, k, v, metadata)


def skew_head(queries: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One KV head: queries (n, D) of its query heads stacked, keys (m, D) -> A (D, D) and its columns
    ranked by |Q A| + |K A| (D,) long."""
    _, _, vh = torch.linalg.svd(queries, full_matrices=False)
    a = vh.transpose(0, 1).contiguous()  # columns: right singular vectors, largest singular value first
    magnitude = (queries @ a).abs().sum(dim=0) + (keys @ a).abs().sum(dim=0)
    return a, magnitude.argsort(descending=True)


@torch.inference_mode()
def compute_skewing(model: LlamaForCausalLM, token_ids: list[int]) -> Skewing:
    """Run ``token_ids`` through ``model`` and skew every layer's heads (see the module doc)."""
    cfg = model.config
    device = model.embed_tokens.weight.device
    n = len(token_ids)
    dtype = model.embed_tokens.weight.dtype if model.embed_tokens.weight.is_floating_point() else torch.float32
    recorder = _Recorder(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, n, dtype, device)
    metadata = AttentionMetadata(seq_ids=(0,), query_lens=(n,), context_lens=(0,))
    model(torch.tensor(token_ids, device=device), torch.arange(n, device=device), recorder, metadata)
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


def sample_tokens(tokenizer, limit: int) -> list[int]:  # noqa: ANN001 - kvserve.tokenizer.Tokenizer
    """The first ``limit`` tokens of the sample prose (Jane Austen's Emma)."""
    with open(require(AUSTEN, "InfiniGen's sample text"), encoding="utf-8") as f:
        text = f.read(limit * 8)
    return tokenizer.encode(text, add_special_tokens=False)[:limit]


def skewing_for(loaded, directory: Path | None = None, refresh: bool = False) -> tuple[Skewing, Path]:  # noqa: ANN001
    """The model's skewing, from the cache file if there is one (else computed and saved); and the file."""
    directory = directory or default_skewing_dir()
    file = directory / f"{model_fingerprint(Path(loaded.path))[:24]}.pt"
    if file.is_file() and not refresh:
        saved = torch.load(file, weights_only=True)
        if saved.get("format") == _FORMAT:
            return Skewing(saved["matrices"], saved["ranking"]), file
    if getattr(loaded, "shard", None) is not None:  # a rank's shard cannot run the sample text alone
        raise ValueError(
            f"InfiniGen under tensor parallelism reads the model's skewing from {file}, which is not there yet: run "
            "`kvserve infinigen-setup` for this model once (one process) first"
        )
    limit = min(SAMPLE_TOKENS, loaded.config.max_position_embeddings)
    get_logger().info("InfiniGen setup: skewing %d layers on %d tokens of sample text", loaded.config.num_layers, limit)
    skewing = compute_skewing(loaded.model, sample_tokens(loaded.tokenizer, limit))
    directory.mkdir(parents=True, exist_ok=True)
    partial = file.with_suffix(f".tmp{os.getpid()}")
    torch.save({"format": _FORMAT, "matrices": skewing.matrices, "ranking": skewing.ranking}, partial)
    partial.replace(file)  # atomic: a concurrent engine never reads half a file
    return skewing, file
