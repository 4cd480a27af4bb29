"""LoRA files read and mapped onto engine weights, and the refit that applies them without a rebuild."""
