"""Artifact store: chained keys, cache hits, atomic writes, verify, gc, concurrency."""

from __future__ import annotations

import json
import multiprocessing
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from sdtrt.config import ExportConfig, SimplifyConfig, not_in_key
from sdtrt.errors import StoreError
from sdtrt.store import MANIFEST, TMP_DIR, Artifact, StageRequest, Store


@dataclass(frozen=True)
class ToyConfig:
    value: int = 1
    verbose: bool = not_in_key(False)


def toy_request(value: int = 1, inputs: tuple[str, ...] = ("model-a",), env: str = "1.0", verbose: bool = False):
    return StageRequest("toy", 1, ToyConfig(value, verbose), [{"digest": d} for d in inputs], {"lib": env})


def write_payload(text: str):
    def build(out: Path) -> dict:
        (out / "payload.txt").write_text(text)
        return {"primary": "payload.txt"}

    return build


def test_key_changes_with_config_inputs_and_environment_only():
    base = toy_request().key
    assert toy_request(verbose=True).key == base, "fields outside the key must not change it"
    assert toy_request(value=2).key != base
    assert toy_request(inputs=("model-b",)).key != base
    assert toy_request(env="1.1").key != base


def test_stage_configs_key_only_output_relevant_fields():
    assert (
        StageRequest("s", 1, SimplifyConfig(check=False), [], {}).key
        == StageRequest("s", 1, SimplifyConfig(), [], {}).key
    )
    assert StageRequest("e", 1, ExportConfig(opset=17), [], {}).key != StageRequest("e", 1, ExportConfig(), [], {}).key


def test_unchanged_rerun_is_a_cache_hit_that_does_no_work(tmp_path):
    store = Store(tmp_path)
    first, hit = store.produce(toy_request(), write_payload("one"))
    assert not hit

    def must_not_run(out: Path) -> dict:
        raise AssertionError("a cache hit must not rebuild")

    again, hit = store.produce(toy_request(), must_not_run)
    assert hit and again.path == first.path and again.key == first.key
    manifest = json.loads((first.path / MANIFEST).read_text())
    assert manifest["files"][0]["name"] == "payload.txt" and len(manifest["files"][0]["sha256"]) == 64
    assert manifest["environment"] == {"lib": "1.0"} and manifest["config"] == {"value": 1, "verbose": False}


def test_failed_stage_leaves_nothing_behind(tmp_path):
    store = Store(tmp_path)

    def crash(out: Path) -> dict:
        (out / "half-written.onnx").write_bytes(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        store.produce(toy_request(), crash)
    assert store.artifacts() == []
    assert list((tmp_path / TMP_DIR).iterdir()) == []
    assert store.lookup(toy_request()) is None


def test_verify_reports_corruption(tmp_path):
    store = Store(tmp_path)
    artifact, _ = store.produce(toy_request(), write_payload("good"))
    assert all(store.verify())
    (artifact.path / "payload.txt").write_text("flipped")
    results = store.verify()
    assert not results[0] and "corrupt" in results[0].problems[0]


def test_gc_removes_leftovers_of_dead_processes_only(tmp_path):
    store = Store(tmp_path)
    store.produce(toy_request(), write_payload("kept"))
    dead = tmp_path / TMP_DIR / "export-0123456789ab-999999999-abcd"
    dead.mkdir()
    removed = store.gc()
    assert removed == [dead] and not dead.exists()
    assert len(store.artifacts()) == 1
    assert store.gc(older_than_days=0, dry_run=True) == [store.artifacts()[0].path]


def _produce_slowly(root: str, tag: str) -> str:
    def build(out: Path) -> dict:
        time.sleep(1.0)
        (out / "payload.txt").write_text(tag)
        return {"primary": "payload.txt"}

    artifact, _ = Store(root).produce(toy_request(), build)
    return str(artifact.path)


def test_concurrent_runs_of_one_key_produce_one_artifact(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        paths = pool.starmap(_produce_slowly, [(str(tmp_path), "a"), (str(tmp_path), "b")])
    assert paths[0] == paths[1]
    store = Store(tmp_path)
    assert len(store.artifacts()) == 1 and all(store.verify())


def test_engines_path_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "engines"
    target.write_text("")
    with pytest.raises(StoreError, match="is a file"):
        Store(target).ensure_writable()


def test_bare_onnx_is_keyed_by_content(tmp_path):
    model = tmp_path / "m.onnx"
    model.write_bytes(b"one")
    key_one = Artifact.open(model).key
    model.write_bytes(b"two")
    assert Artifact.open(model).key != key_one
