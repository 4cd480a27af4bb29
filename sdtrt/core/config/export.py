"""The export stage's configuration: torch → ONNX."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError
from .components import BUILDABLE, IMAGE_ENCODER, TEXT_ENCODERS, Component
from .keys import not_in_key
from .precision import PRECISIONS, Precision

Exporter = Literal["auto", "dynamo", "torchscript"]
IONaming = Literal["named", "indexed"]
Weights = Literal["auto", "load", "stream"]
# CLIP towers, whose fp16 graph only torch.export's exporter writes right (below).
CLIP_ENCODERS = (*TEXT_ENCODERS, IMAGE_ENCODER)


@dataclass(frozen=True)
class ExportConfig:
    """torch → ONNX. The UNet's batch, height and width are always dynamic axes."""

    precision: Precision = "fp16"
    opset: int = 18
    # Both exporters were verified against PyTorch fp32 on ONNX Runtime. "auto" takes torch.export's for every
    # network over 64 MiB of weights, whose weights it then streams (stages/export.py exporter_for), and the
    # TorchScript-based one for smaller networks (the tiny UNet in ~2 s instead of ~20 s) except for fp16 text
    # encoders, where it writes LayerNorms with fp32 weights on fp16 inputs, a graph ONNX Runtime refuses
    # (transformers keeps CLIP's LayerNorms fp32); torch.export's does not.
    exporter: Exporter = "auto"
    # "indexed" names IO input_0.. / output_0, which `torchtrtc --embed-engine` expects.
    io_naming: IONaming = "named"
    component: Component = "unet"
    # How weights reach the graph: "load" the network whole, or "stream" them from the safetensors files into a
    # weight-free trace (torch.export's exporter; the same graph, tested); "auto" streams wherever torch.export's
    # exporter runs, except for IP-Adapter networks (stages/export.py weights_path).
    weights: Weights = not_in_key("auto")
    # An IP-Adapter weight file (h94/IP-Adapter's layout, its image_encoder/ beside it): the UNet's graph gets its
    # image-projection attention, the image embeds and a per-layer scale as inputs. The path is no part of the key; the
    # file's digest is, through the UNet's graph spec (spec/unet.py).
    ip_adapter: str = not_in_key("")
    # The IP-Adapter's image encoder folder where it is not the image_encoder/ beside the file (diffusers'
    # image_encoder_folder: h94's sdxl_models/ip-adapter_sdxl_vit-h needs models/image_encoder). Its digest keys the
    # image encoder's graph; its projection_dim is checked against the adapter's before any export.
    ip_adapter_image_encoder: str = not_in_key("")

    @property
    def chosen_exporter(self) -> Literal["dynamo", "torchscript"]:
        if self.exporter != "auto":
            return self.exporter
        # bf16: torch.export's, the one measured on bf16 UNet, VAE and CLIP graphs.
        if self.precision == "bf16" or (self.component in CLIP_ENCODERS and self.precision == "fp16"):
            return "dynamo"
        return "torchscript"

    def __post_init__(self) -> None:
        if self.component not in BUILDABLE:
            raise ConfigError(f"component '{self.component}' is not one of {', '.join(BUILDABLE)}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision '{self.precision}' is not one of {', '.join(PRECISIONS)}")
        if self.exporter not in ("auto", "dynamo", "torchscript"):
            raise ConfigError(f"exporter '{self.exporter}' is not auto, dynamo or torchscript")
        if self.exporter == "torchscript" and self.component in CLIP_ENCODERS and self.precision == "fp16":
            raise ConfigError(
                "the TorchScript-based exporter writes an invalid fp16 CLIP encoder graph (fp32 LayerNorm weights "
                "on fp16 inputs); use --exporter dynamo (or auto)"
            )
        if self.io_naming not in ("named", "indexed"):
            raise ConfigError(f"io naming '{self.io_naming}' is not named or indexed")
        if self.weights not in ("auto", "load", "stream"):
            raise ConfigError(f"weights '{self.weights}' is not auto, load or stream")
        if self.weights == "stream" and self.exporter == "torchscript":
            raise ConfigError("streamed weights need torch.export's exporter; use --exporter dynamo (or auto)")
        if not 14 <= self.opset <= 23:
            raise ConfigError(f"opset {self.opset} is outside 14..23, the range sdtrt exports")
