"""Package data: the bundled demo model's files (``demo_model/``) and ``modeling_gdnprune.py``, the modeling
file of self-contained outputs (read as bytes by :mod:`gdnprune.checkpoint.remote_code`, never imported)."""
