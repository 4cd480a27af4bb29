"""Shared fixtures: one models cache and one artifact store per session, tiny model throughout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def session_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder for the whole run: with pytest-xdist, the one all workers share (beside their own temp
    folders), so a preset or an engine one worker built is a cache hit for the others. Both caches are
    safe to share: presets are renamed into place atomically, and the store locks each key."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / name
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp(name)


@pytest.fixture(scope="session", autouse=True)
def offline_models_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Presets build once per session into a private cache; nothing reaches the hub."""
    cache = Path(os.environ.get("SDTRT_TEST_MODELS") or session_dir(tmp_path_factory, "models"))
    os.environ["SDTRT_MODELS"] = str(cache)
    os.environ["HF_HUB_OFFLINE"] = "1"
    return cache


@pytest.fixture(scope="session")
def tiny():
    from sdtrt.sources.models import resolve_model

    return resolve_model("tiny")


@pytest.fixture(scope="session", autouse=True)
def store(tmp_path_factory: pytest.TempPathFactory):
    """The session's artifact store. The CLI runs of the tests use it too (SDTRT_ENGINES) unless they pass
    --engines: the store is content-addressed and locked per key, so what one test compiled is a cache hit
    for the next, in this process or another."""
    from sdtrt.core.store import Store

    root = session_dir(tmp_path_factory, "engines")
    os.environ["SDTRT_ENGINES"] = str(root)
    return Store(root)


@pytest.fixture(scope="session")
def optimizer_inputs() -> dict:
    """(model folder, component, precision) → None, which a test sets before it calls streamed_export, then a copy of
    the graph the exporter's optimizer was given there where this process traced it (None on a cache hit):
    tests/test_export_optimizer.py runs both optimizers on it without tracing the network again. Only keys asked for
    are kept (a copy holds the network's weights)."""
    return {}


@pytest.fixture(scope="session")
def streamed_export(tmp_path_factory: pytest.TempPathFactory, optimizer_inputs: dict):
    """(model, component, precision) → a weight-free traced export whose weights were streamed from the safetensors
    files into ``.onnx.data`` (every initializer over 1000 bytes): the path and layout multi-GB networks get
    (``sdtrt export --weights stream``). Its own store, shared by the session's workers: `weights` is not in the
    cache key, so the session store would answer with the loaded export. What its optimizer was given is kept in
    ``optimizer_inputs`` where a test asked for it (the optimizer then runs as ever)."""
    import onnx_ir as ir
    from torch.onnx._internal.exporter._onnx_program import ONNXProgram

    from sdtrt.core.config import ExportConfig
    from sdtrt.core.store import Store
    from sdtrt.graph import onnx_graph
    from sdtrt.stages import export

    store = Store(session_dir(tmp_path_factory, "streamed"))
    optimize = ONNXProgram.optimize

    def get(model, component: str, precision: str):
        config = ExportConfig(precision, exporter="dynamo", component=component, weights="stream")

        def kept(program: ONNXProgram) -> None:
            if (key := (str(model.path), component, precision)) in optimizer_inputs:
                optimizer_inputs[key] = ir.from_proto(ir.to_proto(program.model))
            optimize(program)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(onnx_graph, "EXTERNAL_DATA_THRESHOLD", 1000)
            patch.setattr(ONNXProgram, "optimize", kept)
            return export.run(config, model, store)

    return get


@pytest.fixture(scope="session")
def loaded_store(tmp_path_factory: pytest.TempPathFactory):
    """A store for exports with ``weights="load"``, shared by the session's workers: auto streams wherever
    torch.export's exporter runs, and `weights` is not in the cache key, so the session store answers a loaded
    request with the streamed export (the same graph)."""
    from sdtrt.core.store import Store

    return Store(session_dir(tmp_path_factory, "loaded"))


@pytest.fixture(scope="session")
def tiny_export(tiny, store):
    from sdtrt.core.config import ExportConfig
    from sdtrt.stages import export

    return export.run(ExportConfig(), tiny, store)


@pytest.fixture(scope="session")
def tiny_simplified(tiny_export, store):
    from sdtrt.core.config import SimplifyConfig
    from sdtrt.stages import simplify

    return simplify.run(SimplifyConfig(), tiny_export, store)


@pytest.fixture(scope="session")
def tiny_engine(tiny, store):
    """The ONNX Runtime UNet engine for tiny, as `sdtrt compile --target onnxruntime --components unet` builds it."""
    from sdtrt.tools.compile import compile_model

    return compile_model(tiny, store, target="onnxruntime", components=("unet",)).final


@pytest.fixture(scope="session")
def tiny_set(tiny, store):
    """tiny's whole ONNX Runtime engine set (fp16, every component), as `sdtrt compile` builds it on a CPU."""
    from sdtrt.tools.compile import compile_model

    return compile_model(tiny, store, "onnxruntime").final


@pytest.fixture(scope="session")
def fp32_engine_sets(store):
    """preset → its fp32 ONNX Runtime engine set (every component), compiled on first use."""
    from sdtrt.core.config import ExportConfig
    from sdtrt.sources.models import resolve_model
    from sdtrt.tools.compile import compile_model

    built: dict[str, object] = {}

    def get(preset: str):
        if preset not in built:
            fp32 = ExportConfig(precision="fp32")
            built[preset] = compile_model(resolve_model(preset), store, "onnxruntime", fp32).final
        return built[preset]

    return get


@pytest.fixture(scope="session")
def cached_sets(store):
    """preset → compile's result for its fp32 ONNX Runtime engine set with a step cache's split members
    (``--caches first-block``: the other members are the pipeline tests' own, cache hits in the session store)."""
    from sdtrt.core.config import ExportConfig
    from sdtrt.sources.models import resolve_model
    from sdtrt.tools.compile import compile_model

    built: dict[str, object] = {}

    def get(preset: str):
        if preset not in built:
            fp32 = ExportConfig(precision="fp32")
            built[preset] = compile_model(resolve_model(preset), store, "onnxruntime", fp32, caches=("first-block",))
        return built[preset].final

    return get


@pytest.fixture
def decisions(monkeypatch):
    """Every First-Block Cache decision diffusers makes, in order: "C" computes the other blocks, "s" skips them."""
    from diffusers.hooks import first_block_cache as fbc

    made: list[str] = []
    rule = fbc.FBCHeadBlockHook._should_compute_remaining_blocks

    def spy(self, residual):
        compute = rule(self, residual)
        made.append("C" if compute else "s")
        return compute

    monkeypatch.setattr(fbc.FBCHeadBlockHook, "_should_compute_remaining_blocks", spy)
    return made


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests need a CUDA GPU with TensorRT (and torch-tensorrt); elsewhere they skip, saying why."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    from sdtrt.core.gpu import tensorrt_missing

    missing = tensorrt_missing()
    if missing:
        marker = pytest.mark.skip(reason=f"needs a CUDA GPU with TensorRT: {missing} (run in the NVIDIA container)")
        for item in gpu_items:
            item.add_marker(marker)
