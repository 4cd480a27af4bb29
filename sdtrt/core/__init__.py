"""Core contracts: errors, configs, families, the artifact store and its locks, progress, the GPU, TensorRT products."""
