"""The process a command runs in: old spellings kept for a release (``deprecation``), safe files
(``fileio``), signals (``interrupts``), optional figures (``figures``) and many processes
(``distributed``). Knows nothing of models."""
