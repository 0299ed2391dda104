"""lm-eval hooks of gdnprune's built-in tasks (written by gdnprune.evaluation.tasks)."""

from gdnprune.evaluation.tasks import (  # noqa: F401
    load_probe_docs,
    load_text_docs,
    nats_per_byte_aggregate,
    nats_per_byte_results,
)
