"""The model ``sdtrt deploy triton`` writes, run by Triton's Python backend: the model's tasks on engines.

Triton hands ``execute`` the requests its dynamic batcher gathered. Each row of each request becomes
a ``GenerateRequest``, checked as the CLI checks one (steps, seed, size on the model's grid and inside
the engine's profile, the images its pipeline needs): a bad request gets a Triton error of one line and
never fails the others. A row's task is the one whose pipeline takes the images it carries (``image``,
``mask_image``, ``control_image``, ``image_reference``; none: text-to-image); the model serves every task of its
family (``served_tasks``), each a pipeline over the same engines (``from_pipe``). Text-to-image rows that share
size, steps and guidance run as one pipeline call of at most ``max_batch`` images; a row with images runs
alone (diffusers' batching of input images is not ``generate``'s).
Imported only inside Triton, where ``triton_python_backend_utils`` exists.

Stopping: on SIGTERM Triton waits for executions in flight before it unloads a model (``finalize`` comes
only after them), so a long generation would hold the server up to its exit timeout. ``sdtrt serve``
therefore creates a stop file (``SDTRT_STOP_FILE``) before it signals Triton; the model checks it after
every denoising step and answers the rows it was running with UNAVAILABLE (HTTP 503). A killed server leaves no
one to answer: the model notices between steps that its process (Triton's stub) lost its parent, and exits it
(``sdtrt serve`` also kills the server's process group once the server is gone, idle stubs included).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__
from ..core.errors import RequestError, SdtrtError, ServeError, one_line
from ..core.families import Task, served_tasks
from ..pipeline.image_inputs import check_pipeline_inputs, control_map_as_image, pick_task, sized_by_image
from ..pipeline.request import GenerateRequest, SizeRule
from .deploy import IMAGE_MODES
from .serve import STOP_FILE_ENV

OPTIONAL = ("negative_prompt", "steps", "guidance", "seed", "height", "width", "strength")
DEFAULTS = GenerateRequest()


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        import torch
        import triton_python_backend_utils as pb_utils

        from ..pipeline.loading import load_pipeline, task_pipelines
        from ..sources.models import resolve_model
        from .deploy import Deployment

        self.deployment = Deployment.open(Path(args["model_repository"]))
        recorded = self.deployment.record["sdtrt_version"]
        if recorded != __version__:
            pb_utils.Logger.log_warn(f"repository written by sdtrt {recorded}, served by sdtrt {__version__}")
        gpu = args["model_instance_kind"] == "GPU"
        if gpu:  # before any engine opens: they open on the current device, and the stub starts every instance on
            # device 0 (python_backend src/pb_stub.cc, Stub::Initialize calls `initialize` with no cudaSetDevice)
            torch.cuda.set_device(int(args["model_instance_device_id"]))
        self.source = resolve_model(str(self.deployment.model))
        # The tasks deploy declared inputs for in config.pbtxt; a repository recorded before them: the family's own.
        self.tasks: dict[Task, str] = self.deployment.record.get("tasks") or served_tasks(self.source.pipeline_class())
        first = next(iter(self.tasks))
        pipe = load_pipeline(
            self.source, self.deployment.engine, task=first,
            dtype=torch.float16 if gpu else torch.float32, weight_budget=self.deployment.weight_budget,
        )  # fmt: skip
        pipe = pipe.to(f"cuda:{args['model_instance_device_id']}") if gpu else pipe
        self.pipes: dict[Task, Any] = task_pipelines(pipe, self.tasks)  # sharing its engines, in its dtype
        self.rule = SizeRule.for_pipeline(pipe)
        self.max_batch = int(self.deployment.record["config"]["max_batch"])
        self.counters = RequestCounters(args["model_name"], args["model_version"])
        self.stop_file = os.environ.get(STOP_FILE_ENV)  # set by `sdtrt serve`; absent under a bare tritonserver
        # This process is the Python backend's stub, tritonserver's child: once the server is killed it is someone
        # else's, and a generation would run on for nobody (then the stub would wait for the server, idle, forever).
        self.server_pid = os.getppid()

    def execute(self, requests: list[Any]) -> list[Any]:
        import triton_python_backend_utils as pb_utils

        errors: dict[int, SdtrtError] = {}  # request index → why it gets no image
        groups: dict[tuple[Any, ...], list[tuple[int, GenerateRequest]]] = {}  # in order: a request's rows stay so
        serial = itertools.count()  # a group of its own for each row with images
        for index, request in enumerate(requests):
            try:
                for task, row in self.parse(request):
                    alone = next(serial) if any(getattr(row, name) is not None for name in IMAGE_MODES) else -1
                    groups.setdefault((task, row.batch_key, alone), []).append((index, row))
            except SdtrtError as exc:
                errors[index] = exc
        images: dict[int, list[np.ndarray]] = {}
        for (task, _, _), group in groups.items():
            for chunk in (group[i : i + self.max_batch] for i in range(0, len(group), self.max_batch)):
                try:
                    self.check_running("before it started")
                    result = self.generate(task, [row for _, row in chunk])
                except SdtrtError as exc:
                    errors.update((index, exc) for index, _ in chunk)
                    continue
                for (index, _), image in zip(chunk, result.images, strict=True):
                    images.setdefault(index, []).append(np.asarray(image, dtype=np.uint8))
        responses = []
        for i in range(len(requests)):
            if i in errors:
                code, reason = _outcome(errors[i])
                self.counters.failure[reason].increment(1)
                error = pb_utils.TritonError(one_line(errors[i]), getattr(pb_utils.TritonError, code))
                responses.append(pb_utils.InferenceResponse(error=error))
            else:
                self.counters.success.increment(1)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("image", np.stack(images[i]))]))
        return responses

    def generate(self, task: Task, rows: list[GenerateRequest]) -> Any:
        """One pipeline call of ``task`` for rows that share their steps, with the deployment's step cache if any."""
        from ..pipeline.loading import generate
        from ..pipeline.step_cache import disable_step_cache, enable_step_cache

        pipe, cache = self.pipes[task], self.deployment.cache
        if cache is None:
            return generate(pipe, rows, on_step=self.stop_between_steps)
        enable_step_cache(pipe, cache, rows[0].steps)  # MagCache's ratios are read for the request's steps
        try:
            return generate(pipe, rows, on_step=self.stop_between_steps)
        finally:
            disable_step_cache(pipe)

    def check_running(self, when: str) -> None:
        """ServeError once ``sdtrt serve`` is stopping the server."""
        if self.stop_file is not None and os.path.exists(self.stop_file):
            raise ServeError(f"the server is stopping: the request was interrupted {when}; send it again")
        if os.getppid() != self.server_pid:  # no one is left to answer, and the stub would wait for it forever
            os._exit(1)

    def stop_between_steps(self, step: int, total: int) -> None:
        self.check_running(f"after {step + 1} of {total} steps")  # raised through the pipeline: it stops now

    def parse(self, request: Any) -> list[tuple[Task, GenerateRequest]]:
        """The request's rows as checked GenerateRequests with their tasks; RequestError for the first problem."""
        import triton_python_backend_utils as pb_utils
        from PIL import Image

        columns: dict[str, list[Any]] = {}
        for name in ("prompt", *OPTIONAL):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                columns[name] = list(tensor.as_numpy().reshape(-1))
        for name, mode in IMAGE_MODES.items():  # Triton checked the dtype (UINT8) and the dims config.pbtxt declares
            if (tensor := pb_utils.get_input_tensor_by_name(request, name)) is not None:
                pixels = np.ascontiguousarray(tensor.as_numpy())
                columns[name] = [Image.fromarray(p[..., 0] if mode == "L" else p, mode) for p in pixels]
        if "prompt" not in columns:
            raise RequestError("the request has no 'prompt' input; send one BYTES prompt per image")
        rows = []
        for i in range(len(columns["prompt"])):  # Triton checked that every input has as many rows
            value = {name: values[i] for name, values in columns.items()}
            negative = value.get("negative_prompt")
            row = GenerateRequest(
                prompt=_text(value["prompt"], "prompt"),
                negative_prompt=None if negative is None else _text(negative, "negative_prompt"),
                steps=int(value.get("steps", DEFAULTS.steps)),
                guidance=_short_decimal(value["guidance"]) if "guidance" in value else None,
                seed=int(value.get("seed", DEFAULTS.seed)),
                height=int(value["height"]) if "height" in value else None,
                width=int(value["width"]) if "width" in value else None,
                strength=_short_decimal(value["strength"]) if "strength" in value else None,
                image=value.get("image"),
                mask_image=value.get("mask_image"),
                control_image=value.get("control_image"),
                image_reference=value.get("image_reference"),
            )
            row = control_map_as_image(row, self.tasks)  # `image` alone stays the control map there too (generate's)
            task = pick_task(row, self.tasks)
            row = sized_by_image(row, self.tasks[task], self.rule.multiple, self.deployment.profile)
            check_pipeline_inputs(row, self.source.pipeline_class(), task, self.rule)  # the control image's ratio too
            self.check_cache(row)
            row = row.sized_for(self.rule)
            if row.steps > self.deployment.max_steps:
                raise RequestError(
                    f"steps {row.steps} is more than this deployment serves (at most {self.deployment.max_steps}); "
                    "ask for fewer, or redeploy with a larger `sdtrt deploy triton --max-steps`"
                )
            assert row.height is not None and row.width is not None  # sized_for sets both
            if problem := self.deployment.profile.size_problem(row.height, row.width):
                raise RequestError(problem)
            rows.append((task, row))
        if len({(task, row.batch_key) for task, row in rows}) > 1:
            raise RequestError("the rows of one request must share their task (the images they carry), height, width, "
                               "steps and guidance")  # fmt: skip
        return rows

    def check_cache(self, row: GenerateRequest) -> None:
        """RequestError for a row the deployment's step cache cannot run (MagCache on an image to edit)."""
        from ..pipeline.step_cache import model_problem

        cache = self.deployment.cache
        from_image = row.image is not None
        if cache is not None and (problem := model_problem(cache, self.source, self.source.name, from_image)):
            raise RequestError(problem)


class RequestCounters:
    """``sdtrt_request_success`` and ``sdtrt_request_failure{reason}`` on Triton's /metrics, per model and version.

    Triton's own ``nv_inference_request_failure`` cannot count a request this model refuses: the Python backend
    reports every request of an execution as a success unless ``execute`` itself raised (python_backend
    src/python_be.cc, TRITONBACKEND_ModelInstanceExecute builds its PbMetricReporter without the responses, and
    only an error from ProcessRequests sets it to failure; r24.10, Triton 2.51, to main). Raising would fail every
    request of the batch, as INTERNAL (HTTP 500). Instances share the counters: Triton's registry merges families
    and label sets of one name (core src/metric_family.cc, prometheus-cpp).
    """

    REASONS = ("refused", "stopping", "error")  # HTTP 400, 503, 500

    def __init__(self, model: str, version: str) -> None:
        import triton_python_backend_utils as pb_utils

        labels = {"model": model, "version": version}
        counter = pb_utils.MetricFamily.COUNTER
        # The families are kept: a family must outlive its metrics (python_backend README, Custom Metrics).
        self.families = (
            pb_utils.MetricFamily("sdtrt_request_success", "Requests answered with images", counter),
            pb_utils.MetricFamily("sdtrt_request_failure", "Requests answered with an error, by reason", counter),
        )
        self.success = self.families[0].Metric(labels)
        self.failure = {reason: self.families[1].Metric(labels | {"reason": reason}) for reason in self.REASONS}


def _outcome(exc: SdtrtError) -> tuple[str, str]:
    """The TritonError code and failure reason for ``exc``: HTTP 400 for a bad request, 503 while the server stops
    (triton-inference-server/server src/http_server.cc HttpCodeFromError: UNAVAILABLE → EVHTP_RES_SERVUNAVAIL),
    500 otherwise."""
    if isinstance(exc, RequestError):
        return "INVALID_ARG", "refused"
    if isinstance(exc, ServeError):
        return "UNAVAILABLE", "stopping"
    return "INTERNAL", "error"


def _text(value: Any, name: str) -> str:
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError as exc:
        raise RequestError(f"input '{name}' is not UTF-8 text ({exc.reason}); send it as UTF-8 BYTES") from exc


def _short_decimal(value: Any) -> float:
    """An FP32 input as the shortest decimal that rounds to it: the value the client meant (0.9, not 0.899999976).

    The pipelines take ``int(steps * strength)`` steps: float32's 0.899999976 at 10 steps gives 8, generate's 0.9
    gives 9. Whatever a client holds, a float32 or a float64, its value arrives as the nearest float32, and every
    decimal of up to 6 significant digits is the shortest that rounds to its float32, so this gives back what any
    client typed. FP64 on the wire would not: a client's float32 0.9, widened, is still 0.899999976. Guidance too,
    for generate's exact image.
    """
    return float(str(np.float32(value)))
