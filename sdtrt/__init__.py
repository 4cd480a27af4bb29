"""sdtrt: make Stable Diffusion fast on NVIDIA GPUs.

Export a diffusers UNet to ONNX, simplify it, build a TensorRT (or ONNX Runtime) engine, and drop it
into a diffusers pipeline, validated against PyTorch.
"""

__version__ = "0.1.0"
