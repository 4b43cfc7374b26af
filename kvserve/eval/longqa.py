"""L-Eval long-document tasks (placeholder while being written)."""

LONGQA_TASKS = ("quality", "natural_question", "topic_retrieval", "meeting", "gov_report")
