"""A client for the model ``sdtrt deploy triton`` serves (tritonclient, HTTP/REST).

Request: ``prompt`` BYTES ``[n, 1]`` (one row per image), optional ``negative_prompt`` BYTES, ``steps``
INT32, ``guidance`` FP32, ``seed`` UINT64, ``height`` and ``width`` INT32, ``strength`` FP32, each ``[n, 1]``;
where the model's pipelines take them, ``image``, ``control_image`` and ``image_reference`` (FLUX.1 Kontext
inpainting's) UINT8 ``[n, h, w, 3]`` and ``mask_image`` UINT8 ``[n, h, w, 1]`` (white is repainted): which of them
a row carries picks its task. Response: ``image`` UINT8 ``[n, height, width, 3]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.errors import RequestError, ServeError, one_line
from ..pipeline.request import GenerateRequest
from .deploy import IMAGE_MODES, TritonDeployConfig

if TYPE_CHECKING:  # numpy is imported where it is used: the CLI imports this module at startup
    import numpy as np

TIMEOUT_S = 300.0  # for an answer: a busy server queues requests, a stopped or stuck one never answers

# input → (Triton datatype, numpy dtype)
DATATYPES = {
    "prompt": ("BYTES", "object"),
    "negative_prompt": ("BYTES", "object"),
    "steps": ("INT32", "int32"),
    "guidance": ("FP32", "float32"),
    "seed": ("UINT64", "uint64"),
    "height": ("INT32", "int32"),
    "width": ("INT32", "int32"),
    "strength": ("FP32", "float32"),
}


def request_inputs(request: GenerateRequest) -> list[Any]:
    """The request as tritonclient HTTP inputs, one row; values left at None are not sent (the server's defaults).
    RequestError for an image that is not a PIL image."""
    import numpy as np
    from PIL import Image

    inputs = []
    for name, (datatype, dtype) in DATATYPES.items():
        value = getattr(request, name)
        if value is None:
            continue
        inputs.append(_input(name, np.array([[value.encode() if isinstance(value, str) else value]], dtype=dtype),
                             datatype))  # fmt: skip
    for name, mode in IMAGE_MODES.items():
        if (image := getattr(request, name)) is None:
            continue
        if not isinstance(image, Image.Image):  # arrays, tensors, lists (FLUX.2 [klein]'s references) go in-process
            raise RequestError(
                f"the Triton client sends {name} as one PIL image, not a {type(image).__name__}: open it with "
                "PIL.Image.open, or pass several references to sdtrt.generate in-process"
            )
        pixels = np.asarray(image.convert(mode), dtype=np.uint8)  # as `sdtrt client` opens it
        inputs.append(_input(name, pixels.reshape(1, *pixels.shape[:2], -1), "UINT8"))
    return inputs


def _input(name: str, data: np.ndarray, datatype: str) -> Any:
    import tritonclient.http as http

    tensor = http.InferInput(name, list(data.shape), datatype)
    tensor.set_data_from_numpy(data)
    return tensor


def remote_image(
    url: str, request: GenerateRequest, model: str = TritonDeployConfig.name, timeout_s: float = TIMEOUT_S
) -> np.ndarray:
    """One image (UINT8 ``[height, width, 3]``) from the server at ``url`` (``host:port``, ``http://`` optional).

    ServeError with the server's message when it refuses the request, cannot be reached, or has not
    answered within ``timeout_s`` seconds.
    """
    import socket
    from http.client import HTTPException

    import numpy as np
    import tritonclient.http as http
    from tritonclient.utils import InferenceServerException

    address = url.removeprefix("http://").rstrip("/")
    client = http.InferenceServerClient(address, connection_timeout=timeout_s, network_timeout=timeout_s)
    try:
        result = client.infer(model, request_inputs(request))
    except InferenceServerException as exc:
        raise ServeError(f"the server at {address} answered: {one_line(exc)}") from exc
    except TimeoutError as exc:  # geventhttpclient's network_timeout: socket.timeout, i.e. TimeoutError
        raise ServeError(
            f"Triton at {address} did not answer within {timeout_s:g} s (busy with other requests, or stuck); "
            "try again later, or pass a longer --timeout"
        ) from exc
    except (ConnectionRefusedError, socket.gaierror) as exc:  # no connection was ever made
        raise ServeError(f"cannot reach Triton at {address}: {one_line(exc)}; is `sdtrt serve` running there?") from exc
    except (OSError, HTTPException) as exc:  # reset, or closed mid-request (geventhttpclient)
        raise ServeError(f"lost Triton at {address}: {one_line(exc)}; is `sdtrt serve` running?") from exc
    finally:
        client.close()  # an open connection holds a stopping server up to its exit timeout
    return np.asarray(result.as_numpy("image"))[0]
