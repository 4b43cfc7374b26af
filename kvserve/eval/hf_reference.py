"""The same log-likelihoods through Hugging Face transformers on the same weights: the cross-check that
keeps kvserve's eval tool honest (``kvserve eval ... --backend hf``). transformers is a bench/test extra."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from kvserve.eval.loglikelihood import Loglikelihood, LoglikelihoodRequest
from kvserve.platform.extras import extra_imports


class TransformersScorer:
    """One sequence per forward pass, float32 by default: a reference, not a fast path."""

    name = "transformers"

    def __init__(self, model, progress: bool = True) -> None:  # noqa: ANN001 - a transformers PreTrainedModel
        self.model = model.eval()
        self.progress = progress

    @classmethod
    def load(cls, model_path: Path, dtype: torch.dtype = torch.float32, progress: bool = True) -> TransformersScorer:
        with extra_imports("eval", "--backend hf"):
            from transformers import AutoModelForCausalLM

        if model_path.suffix == ".gguf":  # transformers dequantises GGUF tensors on load
            model = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        return cls(model, progress)

    @torch.inference_mode()
    def loglikelihood(self, requests: Sequence[LoglikelihoodRequest]) -> list[Loglikelihood]:
        from tqdm import tqdm

        results = []
        total = sum(len(r.context) + len(r.continuation) for r in requests)
        with tqdm(total=total, desc="Scoring (transformers)", unit="tok", unit_scale=True, file=sys.stderr,
                  disable=not self.progress, dynamic_ncols=True) as bar:  # fmt: skip
            for request in requests:
                ids = torch.tensor([request.context + request.continuation])  # (1, T)
                logits = self.model(ids).logits[0, len(request.context) - 1 : -1].float()  # (C, vocab)
                logprobs = torch.log_softmax(logits, dim=-1)
                target = torch.tensor(request.continuation)
                chosen = logprobs.gather(1, target[:, None])[:, 0]
                greedy = bool((logprobs.argmax(dim=-1) == target).all())
                results.append(Loglikelihood(float(chosen.sum()), greedy, len(request.continuation)))
                bar.update(ids.shape[1])
        return results
