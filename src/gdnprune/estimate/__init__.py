"""What a run will cost before it runs, without torch: a model's tensors from its safetensors headers or its
config (:mod:`.inventory`), distillation's memory model (:mod:`.memory`), a small table of devices' peak
FLOP/s and bandwidth (:mod:`.devices`), and each stage's FLOPs, bytes, memory and wall time (:mod:`.stages`),
which ``gdnprune estimate`` and every long command's ``--dry-run`` print."""
