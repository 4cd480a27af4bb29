"""Shared fixtures: one models cache and one artifact store per session, tiny model throughout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def offline_models_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Presets build once per session into a private cache; nothing reaches the hub."""
    cache = Path(os.environ.get("SDTRT_TEST_MODELS") or tmp_path_factory.mktemp("models"))
    os.environ["SDTRT_MODELS"] = str(cache)
    os.environ["HF_HUB_OFFLINE"] = "1"
    return cache


@pytest.fixture(scope="session")
def tiny():
    from sdtrt.models import resolve_model

    return resolve_model("tiny")


@pytest.fixture(scope="session")
def store(tmp_path_factory: pytest.TempPathFactory):
    from sdtrt.store import Store

    return Store(tmp_path_factory.mktemp("engines"))


@pytest.fixture(scope="session")
def tiny_export(tiny, store):
    from sdtrt.config import ExportConfig
    from sdtrt.stages import export

    return export.run(ExportConfig(), tiny, store)


@pytest.fixture(scope="session")
def tiny_simplified(tiny_export, store):
    from sdtrt.config import SimplifyConfig
    from sdtrt.stages import simplify

    return simplify.run(SimplifyConfig(), tiny_export, store)


@pytest.fixture(scope="session")
def tiny_engine(tiny, store):
    """The ONNX Runtime UNet engine for tiny, as `sdtrt compile --target onnxruntime --components unet` builds it."""
    from sdtrt.compile import compile_model

    return compile_model(tiny, store, target="onnxruntime", components=("unet",)).final


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests need a CUDA GPU with TensorRT (and torch-tensorrt); elsewhere they skip, saying why."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    from sdtrt.gpu import tensorrt_missing

    missing = tensorrt_missing()
    if missing:
        marker = pytest.mark.skip(reason=f"needs a CUDA GPU with TensorRT: {missing} (run in the NVIDIA container)")
        for item in gpu_items:
            item.add_marker(marker)
