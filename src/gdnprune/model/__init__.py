"""What a model is and how its parts couple: config access, the GDN and sub-block geometries and their
canonical index formulas, the layout tables, targets, layer removal as data, the sub-block surgery on a
loaded model, and running a model (``forwards``) or timing its parts (``latency``)."""
