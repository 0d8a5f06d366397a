"""The commands around a run, each `troll VERB`: `evaluate` (with its `predictions`), `inspect` (a page of a run's
tokens), `plot`, `check` (the acceptance check of a preset), `export`, and `watch` (what the check measures). A new
tool goes here, with a verb in troll/__main__.py."""
