"""The engine: one composition path (TP/SP -> PP -> materialise -> optimizer -> DP) and its steps."""
