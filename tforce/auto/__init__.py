"""`--method auto`, above the engine: the planner chooses a method and gammas from stage costs measured by a
calibration (or read from its cache) and projected to the run's length (docs/auto.md)."""
