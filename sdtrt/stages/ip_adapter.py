"""IP-Adapter in a denoiser's graph (a UNet's, Flux's transformer's): the adapter loaded into the network as diffusers
loads it, and its per-layer scale an input.

diffusers' IPAdapterAttnProcessor2_0 (FluxIPAdapterAttnProcessor) adds ``scale * attention(query, to_k_ip(image),
to_v_ip(image))`` to each attention output it holds, the UNet's skipping the branch where the scale is 0 (Python floats
set by ``set_ip_adapter_scale``). In the graph each layer's scale is one element of the ``ip_adapter_scale`` input,
read where the processor multiplies; the branch is always computed (a scale of 0 adds 0, the output the skip gives).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..core.artifact import Artifact
from ..core.config import IMAGE_ENCODER
from ..core.errors import ArtifactError, ConfigError, ModelNotFoundError
from ..sources.ip_adapters import IPAdapterFiles, ip_layers, resolve_ip_adapter
from ..sources.models import ModelSource, load_folder
from ..spec import FOLDERS, DenoiserSpec, FluxTransformerSpec, UNetSpec
from ..spec.denoiser import IP_SCALE

if TYPE_CHECKING:
    import torch


def with_ip_adapter(spec: DenoiserSpec, files: IPAdapterFiles, model: ModelSource) -> DenoiserSpec:
    """The denoiser's contract with this adapter's inputs; its digest makes the graph's key."""
    if type(spec) not in (UNetSpec, FluxTransformerSpec):
        raise ConfigError(f"IP-Adapter goes into a whole UNet's or Flux transformer's graph, not the {spec.label}'s")
    width = files.shapes()["image_proj.proj.weight"][-1]
    return replace(spec, image_embeds_dim=width, ip_layers=ip_layers(model), ip_adapter_digest=files.digest())


def load_ip_adapter_weights(network: Any, files: IPAdapterFiles) -> None:
    """The adapter's image projection and attention processors in ``network`` (a UNet2DConditionModel or
    FluxTransformer2DModel), as the pipeline's load_ip_adapter puts them there: in the network's dtype (its default
    path), its scales 1."""
    network._load_ip_adapter_weights([files.state_dict()])


def recorded_config(member: Artifact) -> dict[str, Any]:
    """The export config a member was exported with (its export manifest's), {} where none is recorded."""
    export = next((a for a in member.lineage() if a.stage == "export"), None)
    return dict(export.manifest.get("config") or {}) if export else {}


def recorded_ip_adapter(member: Artifact) -> IPAdapterFiles | None:
    """The files of the adapter a denoiser or image encoder member was exported with (where its export recorded
    them), None for one without: what PyTorch loads (validation, an image encoder outside the set); ArtifactError
    where they are gone. The engines themselves need them not."""
    config = recorded_config(member)
    if not (path := config.get("ip_adapter")):
        return None
    try:
        return resolve_ip_adapter(path, config.get("ip_adapter_image_encoder") or None)
    except ModelNotFoundError as exc:
        raise ArtifactError(
            f"the engine {member.path} was compiled with the IP-Adapter {path}, whose files PyTorch loads here and "
            f"are gone ({exc}): put them back there"
        ) from None


def reference_network(
    pipe: Any, model: ModelSource, component: str, member: Artifact, given: IPAdapterFiles | None = None
) -> tuple[Any, bool]:
    """The PyTorch network a member is checked against: the pipeline's, or the model's (second value: True where an
    IP-Adapter was loaded into it, for the caller to unload), or an IP-Adapter's image encoder. The adapter's files:
    ``given`` (the compile's) for a member exported with one, else where its export recorded them."""
    recorded = recorded_config(member).get("ip_adapter")
    files = (given or recorded_ip_adapter(member)) if recorded else None
    if component == IMAGE_ENCODER:
        assert files is not None  # an image encoder member is exported from its adapter
        return files.load_image_encoder(), False
    network = getattr(pipe, FOLDERS[component], None) or load_folder(model, FOLDERS[component])
    if files is not None:
        load_ip_adapter_weights(network, files)
    return network, files is not None


class GraphScale:
    """One layer's IP-Adapter scale as the processor sees it: never 0 to its skip test (the graph always computes the
    image branch) and, where it multiplies, the input's element in the branch's dtype."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return False

    def __mul__(self, other: torch.Tensor) -> torch.Tensor:
        return self.value.to(other.dtype) * other

    __rmul__ = __mul__


def ip_adapter_call(
    network: Any, denoiser: Callable[..., torch.Tensor], spec: DenoiserSpec
) -> Callable[..., torch.Tensor]:
    """``denoiser`` (the graph module's call of ``network``, the adapter loaded) with each IP-Adapter layer's scale
    read from the ``ip_adapter_scale`` input."""
    at = spec.canonical_inputs.index(IP_SCALE)

    def call(*inputs: torch.Tensor) -> torch.Tensor:
        with graph_scales(network, spec.ip_layers, inputs[at]):
            return denoiser(*inputs)

    return call


@contextlib.contextmanager
def graph_scales(network: Any, layers: tuple[str, ...], scales: torch.Tensor) -> Iterator[None]:
    processors = network.attn_processors
    if missing := [name for name in layers if not hasattr(processors.get(name), "to_k_ip")]:
        raise ArtifactError(f"the UNet has no IP-Adapter processor at {missing[0]}: load the adapter first")
    before = {name: processors[name].scale for name in layers}
    try:
        for i, name in enumerate(layers):
            processors[name].scale = [GraphScale(scales[i])]
        yield
    finally:
        for name, scale in before.items():
            processors[name].scale = scale
