"""One training run's machinery around the algorithm (troll.train): the run folder, resume and checkpoints
(`harness`), its start (`start`: model, optimiser, rollout engine), the supervised warm-start (`warmstart`), what a
step measures (`diagnostics`), the per-token records (`records`) and the run's files read back (`runfiles`)."""
