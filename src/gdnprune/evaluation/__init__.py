"""Models side by side: their quality on lm-eval tasks and built-in recall probes (``gdnprune eval``) and their
latency at serving workloads (``gdnprune bench``)."""
