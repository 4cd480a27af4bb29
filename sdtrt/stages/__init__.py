"""Stages: each ``run(config, input, store) -> Artifact`` is eager and cached by the store."""
