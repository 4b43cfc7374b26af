"""Evaluation: perplexity, multiple-choice accuracy, long-document QA and needle retrieval, for any engine setup."""
