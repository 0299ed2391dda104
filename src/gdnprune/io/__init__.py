"""Files in and out: safetensors headers and byte copies, the scores and plan file formats, and models
loaded from folders (whole, or sharded straight from the files)."""
