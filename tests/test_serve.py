"""Serving on a real Triton Inference Server (nvidia-pytriton's tritonserver), loopback only, bounded.

One server per module serves the tiny model's engine set from a repository that was moved after
it was written; every test that stops a server starts its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import pytest

from sdtrt.pipeline.request import GenerateRequest

from .helpers import last_line, run_cli

pytest.importorskip("pytriton", reason="needs the serve extra: pip install 'sdtrt[serve]'")

SIZE = 128  # the tiny engine profile's smallest side: the cheapest image
FAST = GenerateRequest(prompt="a lighthouse at dusk", steps=2, seed=7, height=SIZE, width=SIZE)
MAX_STEPS = 1000  # the scheduler's timesteps: no request asks for more
# About a minute at the profile's largest size (500 steps at 128² took under 3 s): interrupted, never run.
# (Not MAX_STEPS: PNDM's 1000 steps fail in diffusers, IndexError: index 1000 is out of bounds.)
SLOW = GenerateRequest(prompt="slow", steps=900, height=384, width=384)


@pytest.fixture(scope="module")
def repository(tiny_set, tmp_path_factory):
    """The deployment, written and then moved: the server must need nothing outside it."""
    from sdtrt.serving.deploy import TritonDeployConfig, deploy_triton

    written = tmp_path_factory.mktemp("written") / "repo"
    deploy_triton(tiny_set, written, TritonDeployConfig(max_steps=MAX_STEPS))
    moved = tmp_path_factory.mktemp("moved") / "repo"
    written.rename(moved)
    return moved


def _serve(repository: Path, log_dir: Path):
    from sdtrt.serving.serve import ServeConfig, free_ports, start_server

    http, grpc, metrics = free_ports(3)
    config = ServeConfig(http_port=http, grpc_port=grpc, metrics_port=metrics, start_timeout_s=120)
    log = (log_dir / f"tritonserver-{http}.log").open("w")
    return start_server(repository, config, log)


@pytest.fixture(scope="module")
def server(repository, tmp_path_factory):
    started = time.perf_counter()
    with _serve(repository, tmp_path_factory.mktemp("logs")) as running:
        print(f"tritonserver ready in {time.perf_counter() - started:.1f} s")
        yield running
    assert running.process.returncode == 0, "SIGTERM stops Triton cleanly"


def _metric(server, name: str, **labels: str) -> float:
    """The value of counter ``name`` for the model, with exactly these other labels."""
    wanted = {"model": "stable_diffusion", "version": "1"} | labels
    with urllib.request.urlopen(server.config.metrics_url, timeout=10) as answer:
        text = answer.read().decode()
    for found in re.finditer(rf"^{name}{{(.*)}} (\S+)$", text, re.MULTILINE):
        if dict(re.findall(r'(\w+)="([^"]*)"', found.group(1))) == wanted:
            return float(found.group(2))
    raise AssertionError(f"{name}{wanted} not in the metrics")


def _raw_infer(server, **inputs: np.ndarray):
    """A request as any Triton client could send it, bypassing sdtrt's client checks."""
    import tritonclient.http as http

    tensors = []
    for name, value in inputs.items():
        datatype = "BYTES" if value.dtype == object else http.np_to_triton_dtype(value.dtype)
        tensor = http.InferInput(name, list(value.shape), datatype)
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    client = http.InferenceServerClient(server.config.http_url, network_timeout=120)
    try:
        return client.infer("stable_diffusion", tensors)
    finally:
        client.close()


def test_deploy_records_what_it_serves(repository, tiny_set):
    model = repository / "stable_diffusion"
    record = json.loads((model / "sdtrt.json").read_text())
    assert record["sdtrt_version"] and record["engine"]["key"] == tiny_set.key
    assert set(record["members"]) == {"unet", "text_encoder", "vae_decoder", "vae_encoder"}
    assert record["model"]["name"] == "tiny" and record["kind"] == "cpu"
    assert record["config"]["max_steps"] == MAX_STEPS
    config = (model / "config.pbtxt").read_text()
    for line in ('backend: "python"', "max_batch_size: 4", "KIND_CPU", "dynamic_batching", 'name: "image"'):
        assert line in config
    assert "from sdtrt.serving.triton_model import TritonPythonModel" in (model / "1" / "model.py").read_text()
    assert not list((model / "1" / "diffusers" / "unet").glob("*.safetensors")), "the UNet engine replaces them"
    assert (model / "1" / "diffusers" / "text_encoder" / "model.safetensors").is_file()
    page = (model / "report.html").read_text()  # the engines' report, for whoever serves them (sdtrt report)
    assert tiny_set.key in page and 'id="provenance"' in page


def test_deploy_a_unet_engine_alone_keeps_the_other_weights(tiny_engine, tmp_path):
    from sdtrt.core.errors import ConfigError
    from sdtrt.serving.deploy import TritonDeployConfig, deploy_triton

    deployment = deploy_triton(tiny_engine, tmp_path, TritonDeployConfig(name="unet_only", kind="cpu"))
    assert set(deployment.record["members"]) == {"unet"} and deployment.engine.is_dir()
    assert (deployment.model / "text_encoder" / "model.safetensors").is_file(), "PyTorch runs the text encoder"
    assert not list((deployment.model / "unet").glob("*.safetensors"))
    with pytest.raises(ConfigError, match="max batch 5 is more than the engine's profile takes"):
        deploy_triton(tiny_engine, tmp_path, TritonDeployConfig(max_batch=5))


def test_server_image_equals_in_process_generate(server, tiny, tiny_set):
    from sdtrt.pipeline.loading import generate, load_pipeline
    from sdtrt.serving.client import remote_image

    served = remote_image(server.config.http_url, FAST)
    local = np.asarray(generate(load_pipeline(tiny, tiny_set), FAST).images[0])
    assert served.dtype == np.uint8 and served.shape == (SIZE, SIZE, 3)
    np.testing.assert_array_equal(served, local)


def test_concurrent_requests_all_succeed_are_batched_and_counted(server):
    from sdtrt.serving.client import remote_image

    requests = [GenerateRequest(prompt=f"request {i}", steps=2, seed=i, height=SIZE, width=SIZE) for i in range(8)]
    before = {m: _metric(server, m) for m in ("nv_inference_request_success", "nv_inference_exec_count")}
    with ThreadPoolExecutor(8) as pool:
        images = list(pool.map(lambda r: remote_image(server.config.http_url, r), requests))
    success = _metric(server, "nv_inference_request_success") - before["nv_inference_request_success"]
    executions = _metric(server, "nv_inference_exec_count") - before["nv_inference_exec_count"]
    print(f"8 concurrent requests: {executions:.0f} executions")
    assert success == 8 and 2 <= executions <= 8, "8 requests in batches of at most max_batch=4"
    assert all(i.shape == (SIZE, SIZE, 3) for i in images)
    # An image depends on its seed, not on the batch it ran in.
    np.testing.assert_array_equal(images[3], remote_image(server.config.http_url, requests[3]))


PROMPT = {"prompt": np.array([[b"a fox"]], dtype=object)}


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"steps": np.array([[2]], dtype=np.int32)}, "no 'prompt' input"),
        (PROMPT | {"height": np.array([[100]], dtype=np.int32)}, "height 100 is not a positive multiple of 16"),
        (PROMPT | {"steps": np.array([[0]], dtype=np.int32)}, "steps 0 must be at least 1"),
        (PROMPT | {"steps": np.array([[MAX_STEPS + 1]], dtype=np.int32)},
         f"steps {MAX_STEPS + 1} is more than this deployment serves (at most {MAX_STEPS})"),
        (PROMPT | {"width": np.array([[512]], dtype=np.int32)}, "width 512 is outside the engine's profile (128..384"),
        (PROMPT | {"steps": np.array([[2.0]], dtype=np.float32)}, "'steps' data-type is 'FP32', but model 'stable_"
                                                                  "diffusion' expects 'INT32'"),
        (PROMPT | {"seed": np.array([[1], [2]], dtype=np.uint64)}, "batch size does not match other inputs"),
    ],
    ids=["no-prompt", "off-grid", "steps-0", "too-many-steps", "outside-profile", "wrong-dtype", "ragged"],
)  # fmt: skip
def test_bad_request_gets_a_clear_error_and_the_next_succeeds(server, inputs, message):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as failed:
        _raw_infer(server, **inputs)
    assert failed.value.status() == "400" and message in failed.value.message()
    size = np.array([[SIZE]], dtype=np.int32)
    good = _raw_infer(server, **PROMPT, steps=np.array([[1]], dtype=np.int32), height=size, width=size)
    assert good.as_numpy("image").shape == (1, SIZE, SIZE, 3)


def test_a_refused_request_counts_as_a_failure(server):
    from tritonclient.utils import InferenceServerException

    from sdtrt.serving.client import remote_image

    names = {"success": ("sdtrt_request_success", {}), "refused": ("sdtrt_request_failure", {"reason": "refused"}),
             "triton_success": ("nv_inference_request_success", {})}  # fmt: skip
    before = {key: _metric(server, name, **labels) for key, (name, labels) in names.items()}
    remote_image(server.config.http_url, FAST)
    with pytest.raises(InferenceServerException) as failed:
        _raw_infer(server, **PROMPT, height=np.array([[100]], dtype=np.int32))
    assert failed.value.status() == "400" and "height 100 is not a positive multiple" in failed.value.message()
    expected = {"success": 1, "refused": 1, "triton_success": 2}
    # Triton records a request's statistics after its response is sent, so its counter may lag the reply a moment
    # (CI17 read 1 once): read again until the counts settle, for at most 10 s.
    deadline = time.monotonic() + 10
    while True:
        counted = {key: _metric(server, name, **labels) - before[key] for key, (name, labels) in names.items()}
        if counted == expected or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert counted == expected, "Triton's own counter cannot tell (README)"


def test_killing_the_server_mid_request_fails_the_client_and_a_restart_serves(repository, tmp_path):
    from sdtrt.core.errors import ServeError
    from sdtrt.serving.client import remote_image

    outcome: dict[str, BaseException | np.ndarray] = {}

    def ask(url: str) -> None:
        try:
            outcome["result"] = remote_image(url, SLOW)
        except BaseException as exc:
            outcome["result"] = exc

    with _serve(repository, tmp_path) as doomed:
        client = threading.Thread(target=ask, args=(doomed.config.http_url,))
        client.start()
        time.sleep(2)  # the request is executing: 500 steps take far longer
        stubs = psutil.Process(doomed.process.pid).children(recursive=True)  # the Python backend's, running it
        doomed.process.kill()
        client.join(60)
    assert isinstance(outcome["result"], ServeError), outcome["result"]
    assert stubs, "the model runs in a stub process of its own"
    # An orphaned stub stops the generation at its next step and exits: it would hold a core for minutes.
    _, alive = psutil.wait_procs(stubs, timeout=60)
    assert not alive, f"stub processes outlived the killed server: {alive}"
    with _serve(repository, tmp_path) as restarted:
        assert remote_image(restarted.config.http_url, FAST).shape == (SIZE, SIZE, 3)


def test_cli_deploy_and_client(server, tiny_set, store, tmp_path):
    from PIL import Image

    deployed = run_cli(
        "deploy", "triton", "--engine", tiny_set.key[:12], "--engines", str(store.root), "--out", str(tmp_path),
        "--model-name", "sd", "--max-batch", "2", "--max-steps", "50", "--no-dynamic-batching", check=True,
    )  # fmt: skip
    folder = Path(last_line(deployed.stdout))
    assert folder == tmp_path / "sd"
    assert json.loads((folder / "sdtrt.json").read_text())["config"]["max_steps"] == 50
    config = (folder / "config.pbtxt").read_text()
    assert "max_batch_size: 2" in config and "dynamic_batching" not in config
    too_big = run_cli("deploy", "triton", "--engine", str(tiny_set.path), "--out", str(tmp_path), "--max-batch", "8")
    assert too_big.returncode == 1
    assert "max batch 8 is more than the engine's profile takes (4 images)" in too_big.stderr
    out = tmp_path / "fox.png"
    asked = run_cli(
        "client", "--url", f"http://{server.config.http_url}", "--prompt", FAST.prompt, "--steps", str(FAST.steps),
        "--seed", str(FAST.seed), "--height", str(SIZE), "--width", str(SIZE), "--out", str(out), check=True,
    )  # fmt: skip
    assert last_line(asked.stdout) == str(out)
    from sdtrt.serving.client import remote_image

    np.testing.assert_array_equal(np.asarray(Image.open(out)), remote_image(server.config.http_url, FAST))
    refused = run_cli("client", "--url", server.config.http_url, "--height", "100", "--out", str(out))
    assert refused.returncode == 1 and "answered: [400] height 100 is not a positive multiple" in refused.stderr


def _serve_cli(repository: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``sdtrt serve`` as a user starts it, its output in ``log``; the process and its HTTP address."""
    from sdtrt.serving.serve import free_ports

    http, grpc, metrics = free_ports(3)
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "sdtrt", "serve", str(repository), "--http-port", str(http),
             "--grpc-port", str(grpc), "--metrics-port", str(metrics)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    return process, f"127.0.0.1:{http}"


def kill_serve(process: subprocess.Popen[bytes]) -> None:
    """A ``_serve_cli`` process still running when its test ends (it failed), killed with its tritonserver: its
    session's whole group, not ``sdtrt serve`` alone, which left the server and its model stubs running."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def wait_serving(process: subprocess.Popen[bytes], log: Path, seconds: float = 180) -> None:
    """Until ``sdtrt serve`` (``_serve_cli``'s process) says it serves; its log in the failure otherwise."""
    deadline = time.monotonic() + seconds
    while "✓ serving" not in log.read_text() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "✓ serving" in log.read_text(), log.read_text()


def test_sigterm_interrupts_the_generation_in_flight_and_serve_exits_cleanly(repository, tmp_path):
    from sdtrt.core.errors import ServeError
    from sdtrt.serving.client import remote_image

    log = tmp_path / "serve.log"
    serve, url = _serve_cli(repository, log)
    try:
        wait_serving(serve, log)
        outcome: dict[str, BaseException | np.ndarray] = {}

        def ask() -> None:
            try:
                outcome["result"] = remote_image(url, SLOW, timeout_s=120)
            except BaseException as exc:
                outcome["result"] = exc

        client = threading.Thread(target=ask)
        client.start()
        time.sleep(3)  # the slow request reaches the one instance first, even on a loaded machine
        # The only instance is busy for a minute: a client with a timeout gives up with one line, not a hang.
        waited = run_cli("client", "--url", url, "--steps", "1", "--height", str(SIZE), "--width", str(SIZE),
                         "--out", str(tmp_path / "never.png"), "--timeout", "1", timeout=120)  # fmt: skip
        assert waited.returncode == 1, waited.stderr
        assert f"Triton at {url} did not answer within 1 s" in waited.stderr
        assert len(waited.stderr.strip().splitlines()) == 1
        stopping = time.perf_counter()
        serve.send_signal(signal.SIGTERM)
        code = serve.wait(120)
        print(f"sdtrt serve exited {time.perf_counter() - stopping:.1f} s after SIGTERM")
        client.join(60)
    finally:
        kill_serve(serve)
    assert code == 0, f"Triton stopped cleanly, not killed at its timeout:\n{log.read_text()[-2000:]}"
    result = outcome["result"]
    assert isinstance(result, ServeError), result
    assert "[503] the server is stopping: the request was interrupted after" in str(result)
    assert "Repository Agent" not in log.read_text(), "Triton's startup tables stay out of the output"


def test_serve_refuses_a_folder_that_is_no_repository_before_starting_triton(tmp_path):
    empty = run_cli("serve", str(tmp_path), timeout=60)
    assert empty.returncode == 1
    assert empty.stderr.strip() == (
        f"error: {tmp_path} is not a Triton model repository (no <model>/config.pbtxt in it); "
        f"write one with `sdtrt deploy triton --engine ENGINE --out {tmp_path}`"
    )
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.pbtxt").write_text('backend: "python"\n')
    foreign = run_cli("serve", str(tmp_path), timeout=60)
    assert foreign.returncode == 1 and len(foreign.stderr.strip().splitlines()) == 1
    assert "holds no model `sdtrt deploy triton` wrote (no sdtrt.json beside other/config.pbtxt)" in foreign.stderr
    # A repository an sdtrt before the layer folders deployed: its model.py imports the Triton model's old path.
    (tmp_path / "other" / "sdtrt.json").write_text("{}\n")
    (tmp_path / "other" / "1").mkdir()
    (tmp_path / "other" / "1" / "model.py").write_text("from sdtrt.triton_model import TritonPythonModel\n")
    stale = run_cli("serve", str(tmp_path), timeout=60)
    assert stale.returncode == 1 and len(stale.stderr.strip().splitlines()) == 1
    assert "other in " in stale.stderr and "was deployed by an older sdtrt" in stale.stderr
    assert "deploy it again: `sdtrt deploy triton" in stale.stderr


def test_serve_a_model_that_fails_to_load_shows_the_reason_in_a_few_lines(repository, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(repository, broken)
    record_path = broken / "stable_diffusion" / "sdtrt.json"
    record = json.loads(record_path.read_text())
    shutil.rmtree(broken / "stable_diffusion" / "1" / record["engine"]["path"])
    log = tmp_path / "serve.log"
    serve, _ = _serve_cli(broken, log)
    try:
        code = serve.wait(300)
    finally:
        kill_serve(serve)
    lines = log.read_text().strip().splitlines()
    assert code == 1
    assert len(lines) <= 6, "Triton's errors, not its whole startup log:\n" + "\n".join(lines)
    assert "model 'stable_diffusion' failed to load: ArtifactError:" in lines[-1]
    assert "does not exist" in lines[-1]


def test_a_flux_schnell_set_is_deployed_and_served(store, tmp_path):
    """A transformer engine set (Flux.1-schnell: no guidance, 16-px grid) served as the UNet sets are."""
    from tritonclient.utils import InferenceServerException

    from sdtrt.core.config import ExportConfig
    from sdtrt.pipeline.loading import generate, load_pipeline
    from sdtrt.serving.deploy import TritonDeployConfig, deploy_triton
    from sdtrt.sources.models import resolve_model
    from sdtrt.tools.compile import compile_model

    source = resolve_model("tiny-flux-schnell")  # the set tests/test_transformer_pipelines.py compiles too
    flux = compile_model(source, store, "onnxruntime", ExportConfig(precision="fp32")).final
    deployment = deploy_triton(flux, tmp_path / "repo", TritonDeployConfig(max_batch=1))
    assert {"transformer", "text_encoder", "text_encoder_2", "vae_decoder"} <= set(deployment.record["members"])
    assert not list((deployment.model / "transformer").glob("*.safetensors")), "the transformer engine replaces them"
    with _serve(tmp_path / "repo", tmp_path) as server:
        served = _raw_infer(
            server,
            **PROMPT,
            steps=np.array([[2]], dtype=np.int32),
            height=np.array([[SIZE]], dtype=np.int32),
            width=np.array([[SIZE]], dtype=np.int32),
        )
        refused = {}
        for name, value in (
            ("guidance", np.array([[3.5]], dtype=np.float32)),
            ("height", np.array([[136]], dtype=np.int32)),
        ):  # on the 8-px grid, off Flux's 16-px one
            with pytest.raises(InferenceServerException) as failed:
                _raw_infer(server, **PROMPT, **{name: value})
            refused[name] = failed.value
    local = generate(load_pipeline(source, flux), GenerateRequest(prompt="a fox", steps=2, height=SIZE, width=SIZE))
    np.testing.assert_array_equal(served.as_numpy("image")[0], np.asarray(local.images[0]))
    assert all(e.status() == "400" for e in refused.values())
    assert "guidance 3.5 was given, but this model has no guidance embedding" in refused["guidance"].message()
    assert "height 136 is not a positive multiple of 16 pixels" in refused["height"].message()


def test_images_on_the_wire_pick_the_task_and_the_cli_client_sends_files(server, tiny, tiny_set, tmp_path):
    """A real Triton takes the UINT8 image inputs config.pbtxt declares: img2img from the library client, inpainting
    from `sdtrt client --image --mask --strength`, each generate's image."""
    from PIL import Image

    from sdtrt.pipeline.loading import generate, load_pipeline
    from sdtrt.serving.client import remote_image

    rng = np.random.default_rng(0)
    photo = Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))
    box = np.zeros((SIZE, SIZE), dtype=np.uint8)
    box[32:96, 32:96] = 255
    img2img = GenerateRequest(prompt="a fox", steps=4, seed=2, strength=0.5, image=photo)
    inpaint = GenerateRequest(prompt="a cat", steps=2, seed=3, height=SIZE, width=SIZE, strength=0.9, image=photo,
                              mask_image=Image.fromarray(box, "L"))  # fmt: skip
    photo.save(tmp_path / "photo.png")
    Image.fromarray(box, "L").save(tmp_path / "mask.png")
    out = tmp_path / "cat.png"
    run_cli(
        "client", "--url", server.config.http_url, "--prompt", inpaint.prompt, "--steps", "2", "--seed", "3",
        "--height", str(SIZE), "--width", str(SIZE), "--strength", "0.9", "--image", str(tmp_path / "photo.png"),
        "--mask", str(tmp_path / "mask.png"), "--out", str(out), check=True,
    )  # fmt: skip
    served = {"img2img": remote_image(server.config.http_url, img2img), "inpaint": np.asarray(Image.open(out))}
    for task, request in (("img2img", img2img), ("inpaint", inpaint)):
        local = np.asarray(generate(load_pipeline(tiny, tiny_set, task=task), request).images[0])
        np.testing.assert_array_equal(served[task], local, err_msg=task)


@pytest.mark.slow  # the FLUX.2 [dev] set builds in about a minute (tests/test_flux2_dev.py's, a cache hit there)
def test_a_flux2_dev_set_is_served_text_to_image_and_with_a_reference_image(store, tmp_path):
    """FLUX.2 [dev] (the Mistral3 LLM encoder, the guidance-embedded Flux2 transformer and its VAE, each an engine)
    on a real Triton: a text-to-image row and a row with a reference image to edit from (the image input the config
    declares, encoded by the VAE encoder engine) each give generate's image."""
    from PIL import Image

    from sdtrt.core.config import ExportConfig
    from sdtrt.pipeline.loading import generate, load_pipeline
    from sdtrt.serving.client import remote_image
    from sdtrt.serving.deploy import TritonDeployConfig, deploy_triton
    from sdtrt.sources.models import resolve_model
    from sdtrt.tools.compile import compile_model

    source = resolve_model("tiny-flux2")
    dev = compile_model(source, store, "onnxruntime", ExportConfig(precision="fp32")).final
    deployment = deploy_triton(dev, tmp_path / "repo", TritonDeployConfig(max_batch=1))
    assert deployment.record["tasks"] == {"txt2img": "Flux2Pipeline"}
    assert {"text_encoder", "transformer", "vae_encoder", "vae_decoder"} <= set(deployment.record["members"])
    assert (
        '{ name: "image", data_type: TYPE_UINT8, dims: [ -1, -1, 3 ], optional: true }'
        in (deployment.folder / "config.pbtxt").read_text()
    )
    reference = Image.fromarray(np.random.default_rng(0).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))
    requests = {
        "txt2img": GenerateRequest(prompt="a fox", steps=2, seed=5, height=SIZE, width=192),
        "reference": GenerateRequest(prompt="a fox", steps=2, seed=5, height=SIZE, width=192, image=reference),
    }
    with _serve(tmp_path / "repo", tmp_path) as server:
        served = {name: remote_image(server.config.http_url, request) for name, request in requests.items()}
    pipe = load_pipeline(source, dev)
    for name, request in requests.items():
        np.testing.assert_array_equal(served[name], np.asarray(generate(pipe, request).images[0]), err_msg=name)
    assert served["txt2img"].shape == (SIZE, 192, 3) and not np.array_equal(served["txt2img"], served["reference"])


@pytest.mark.slow  # the Kontext set's compile (tests/test_flux_tasks.py's, a cache hit there) and a server of its own
def test_a_kontext_set_serves_inpaint_rows_with_and_without_a_reference_image(store, tmp_path):
    """FLUX.1 Kontext inpainting on a real Triton: an image + mask_image row (the image its own reference) and one
    with an image_reference too (the UINT8 input config.pbtxt declares), each generate's image bit for bit."""
    from PIL import Image

    from sdtrt.core.config import ExportConfig
    from sdtrt.pipeline.loading import generate, load_pipeline
    from sdtrt.serving.client import remote_image
    from sdtrt.serving.deploy import TritonDeployConfig, deploy_triton
    from sdtrt.sources.models import resolve_model
    from sdtrt.tools.compile import compile_model

    source = resolve_model("tiny-flux-kontext")
    kontext = compile_model(source, store, "onnxruntime", ExportConfig(precision="fp32")).final
    deployment = deploy_triton(kontext, tmp_path / "repo", TritonDeployConfig(max_batch=1))
    assert deployment.record["tasks"] == {"img2img": "FluxKontextPipeline", "inpaint": "FluxKontextInpaintPipeline"}
    assert (
        '{ name: "image_reference", data_type: TYPE_UINT8, dims: [ -1, -1, 3 ], optional: true }'
        in (deployment.folder / "config.pbtxt").read_text()
    )
    rng = np.random.default_rng(0)
    photo = Image.fromarray(rng.integers(0, 256, (96, 160, 3), dtype=np.uint8))
    reference = Image.fromarray(rng.integers(0, 256, (160, 96, 3), dtype=np.uint8))  # another aspect ratio
    box = np.zeros((96, 160), dtype=np.uint8)
    box[24:72, 40:120] = 255
    inpaint = GenerateRequest(prompt="a fox", steps=2, seed=5, height=SIZE, width=192, strength=0.8, image=photo,
                              mask_image=Image.fromarray(box, "L"))  # fmt: skip
    requests = {"inpaint": inpaint, "reference": dataclasses.replace(inpaint, image_reference=reference)}
    with _serve(tmp_path / "repo", tmp_path) as server:
        served = {name: remote_image(server.config.http_url, request) for name, request in requests.items()}
    pipe = load_pipeline(source, kontext, task="inpaint")
    for name, request in requests.items():
        np.testing.assert_array_equal(served[name], np.asarray(generate(pipe, request).images[0]), err_msg=name)
    assert served["inpaint"].shape == (SIZE, 192, 3) and not np.array_equal(served["inpaint"], served["reference"])
