"""The drop-in pipeline: a family's own diffusers pipeline whose networks are engines."""
