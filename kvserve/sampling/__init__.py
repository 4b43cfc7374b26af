"""From logits to tokens: sampling parameters, the sampler, beam search, stop strings."""
