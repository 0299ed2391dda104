"""Choosing under budgets, on costs and measured sensitivities only (no torch): the exact MILP and its
solution pool, servable plans, layer removal as a candidate, the evolutionary search over whole plans."""
