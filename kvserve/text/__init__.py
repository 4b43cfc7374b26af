"""Text in and out: tokenizers, prompts, chat tool prompts, incremental detokenisation."""
