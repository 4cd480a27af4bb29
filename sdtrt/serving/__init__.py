"""Triton Inference Server: the model repository, the Python backend model, the server and a client."""
