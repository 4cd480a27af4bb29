"""A client for the text-to-image model ``sdtrt deploy triton`` serves (tritonclient, HTTP/REST).

Request: ``prompt`` BYTES ``[n, 1]`` (one row per image), optional ``negative_prompt`` BYTES, ``steps``
INT32, ``guidance`` FP32, ``seed`` UINT64, ``height`` and ``width`` INT32, each ``[n, 1]``. Response:
``image`` UINT8 ``[n, height, width, 3]``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .deploy import TritonDeployConfig
from .errors import ServeError, one_line
from .request import GenerateRequest

# input → (Triton datatype, numpy dtype)
DATATYPES = {
    "prompt": ("BYTES", np.object_),
    "negative_prompt": ("BYTES", np.object_),
    "steps": ("INT32", np.int32),
    "guidance": ("FP32", np.float32),
    "seed": ("UINT64", np.uint64),
    "height": ("INT32", np.int32),
    "width": ("INT32", np.int32),
}


def request_inputs(request: GenerateRequest) -> list[Any]:
    """The request as tritonclient HTTP inputs, one row; values left at None are not sent (the server's defaults)."""
    import tritonclient.http as http

    inputs = []
    for name, (datatype, dtype) in DATATYPES.items():
        value = getattr(request, name)
        if value is None:
            continue
        data = np.array([[value.encode() if isinstance(value, str) else value]], dtype=dtype)
        tensor = http.InferInput(name, list(data.shape), datatype)
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    return inputs


def txt2img(
    url: str, request: GenerateRequest, model: str = TritonDeployConfig.name, timeout_s: float = 600.0
) -> np.ndarray:
    """One image (UINT8 ``[height, width, 3]``) from the server at ``url`` (``host:port``, ``http://`` optional).

    ServeError with the server's message when it refuses the request or cannot be reached.
    """
    from http.client import HTTPException

    import tritonclient.http as http
    from tritonclient.utils import InferenceServerException

    address = url.removeprefix("http://").rstrip("/")
    client = http.InferenceServerClient(address, connection_timeout=timeout_s, network_timeout=timeout_s)
    try:
        result = client.infer(model, request_inputs(request))
    except InferenceServerException as exc:
        raise ServeError(f"the server at {address} answered: {one_line(exc)}") from exc
    except (OSError, HTTPException) as exc:  # refused, reset, or closed mid-request (geventhttpclient)
        raise ServeError(f"lost Triton at {address}: {one_line(exc)}; is `sdtrt serve` running?") from exc
    finally:
        client.close()  # an open connection holds a stopping server up to its exit timeout
    return np.asarray(result.as_numpy("image"))[0]
