"""ONNX graphs: named IO read back from a saved graph, and their weights (external data, dtypes)."""
