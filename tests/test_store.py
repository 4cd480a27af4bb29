"""Artifact store: chained keys, cache hits, atomic writes, verify, gc, concurrency."""

from __future__ import annotations

import json
import multiprocessing
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from sdtrt.core.artifact import MANIFEST, Artifact
from sdtrt.core.config import ExportConfig, SimplifyConfig, not_in_key
from sdtrt.core.errors import ArtifactError, StoreError
from sdtrt.core.stage_request import StageRequest
from sdtrt.core.store import TMP_DIR, Store


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
    assert not results[0] and results[0].problems == ["payload.txt has 7 bytes, the manifest 4"]


def test_gc_removes_leftovers_of_dead_processes_only(tmp_path):
    store = Store(tmp_path)
    store.produce(toy_request(), write_payload("kept"))
    dead = tmp_path / TMP_DIR / "export-0123456789ab-999999999-abcd"
    dead.mkdir()
    assert store.gc().removed == [dead] and not dead.exists()
    assert len(store.artifacts()) == 1
    assert store.gc(older_than_days=0, dry_run=True).removed == [store.artifacts()[0].path]


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


def test_a_run_waiting_for_anothers_lock_says_so_naming_it(tmp_path, capsys):
    """A second run of a key waits for the first's lock, and says once which run (its pid) holds it for what."""
    import threading

    building, release = threading.Event(), threading.Event()

    def build(out: Path) -> dict:
        building.set()
        release.wait(30)
        return write_payload("first")(out)

    store, request = Store(tmp_path), toy_request()
    first = threading.Thread(target=store.produce, args=(request, build))
    first.start()
    assert building.wait(30)
    second: list[tuple[Artifact, bool]] = []
    waiting = threading.Thread(target=lambda: second.append(Store(tmp_path).produce(request, write_payload("no"))))
    waiting.start()
    err = ""
    for _ in range(300):  # until the waiting run has said so
        err += capsys.readouterr().err
        if "waiting:" in err:
            break
        time.sleep(0.1)
    release.set()
    first.join(30)
    waiting.join(30)
    assert f"waiting: another sdtrt run (pid {os.getpid()}) is making toy {request.key[:16]}" in err
    assert err.count("waiting:") == 1 and second[0][1], "the waiting run takes the first's artifact"


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


def test_a_corrupt_hit_is_rebuilt_not_handed_out(tmp_path, capsys):
    store = Store(tmp_path)
    first, _ = store.produce(toy_request(), write_payload("good payload"))
    (first.path / "payload.txt").write_text("truncated")  # a different size
    again, hit = store.produce(toy_request(), write_payload("good payload"))
    assert not hit and (again.path / "payload.txt").read_text() == "good payload"
    assert "is corrupt: payload.txt has 9 bytes, the manifest 12; rebuilding" in capsys.readouterr().err
    (again.path / "payload.txt").write_text("evil payload")  # same size: only the hash tells
    third, hit = store.produce(toy_request(), write_payload("good payload"))
    assert not hit and (third.path / "payload.txt").read_text() == "good payload"
    assert store.produce(toy_request(), write_payload("unused"))[1], "an intact artifact is a hit"
    assert "toy: cached" in capsys.readouterr().err


def test_opening_a_corrupt_artifact_says_how_to_rebuild(tmp_path):
    store = Store(tmp_path)
    artifact, _ = store.produce(toy_request(), lambda out: write_payload("x")(out) | {"reproduce": "sdtrt toy"})
    artifact.require_intact()
    (artifact.path / "payload.txt").unlink()
    with pytest.raises(ArtifactError, match=r"is corrupt: payload.txt is missing; rebuild it with `sdtrt toy`"):
        Artifact.open(artifact.path).require_intact()


def test_artifact_folders_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        artifact, _ = Store(tmp_path).produce(toy_request(), write_payload("x"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(artifact.path.stat().st_mode) == 0o755


def test_artifact_files_follow_the_umask_whatever_wrote_them(tmp_path):
    """onnx ≥ 1.2x writes a graph's external data file 0600: a server in another account could not read it."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    weights = numpy_helper.from_array(np.ones((600, 600), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Identity", ["w"], ["y"])], "g", [], [helper.make_tensor_value_info("y", 1, [600, 600])],
        [weights],
    )  # fmt: skip

    def write_graph(out: Path) -> dict:
        onnx.save_model(
            helper.make_model(graph), str(out / "g.onnx"), save_as_external_data=True, location="g.onnx.data"
        )
        return {"primary": "g.onnx"}

    old = os.umask(0o022)
    try:
        artifact, _ = Store(tmp_path).produce(toy_request(), write_graph)
    finally:
        os.umask(old)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in artifact.path.iterdir() if f.name.startswith("g.")}
    assert modes == {"g.onnx": 0o644, "g.onnx.data": 0o644}
    artifact.require_intact()  # the modes changed before the files were signed


def test_gc_corrupt_removes_what_verify_flags(tmp_path):
    store = Store(tmp_path)
    good, _ = store.produce(toy_request(1), write_payload("good"))
    bad, _ = store.produce(toy_request(2), write_payload("bad"))
    (bad.path / "payload.txt").write_text("flipped")
    assert store.gc().removed == [], "plain gc keeps artifacts, corrupt or not"
    result = store.gc(corrupt=True)
    assert result.removed == [bad.path] and result.failed == [] and not bad.path.exists() and good.path.exists()


def test_find_by_path_key_or_stage_and_key(tmp_path):
    store = Store(tmp_path)
    one, _ = store.produce(toy_request(1), write_payload("1"))
    assert store.find(one.path).key == one.key
    assert store.find(one.key[:8]).key == one.key and store.find(f"toy/{one.key[:6]}").key == one.key
    with pytest.raises(ArtifactError, match="does not exist and is not an artifact key"):
        store.find("export/" + one.key[:8])
    with pytest.raises(ArtifactError, match="does not exist and is not an artifact key"):
        store.find("/no/such/folder")


def test_lineage_of_a_relative_store_is_found_from_any_directory(tmp_path, monkeypatch):
    """Artifacts made in ./engines record where their inputs are absolutely: a later command run elsewhere (a LoRA's
    weight map, a stripped plan's graph) still finds them."""
    monkeypatch.chdir(tmp_path)
    store = Store("engines")
    first, _ = store.produce(toy_request(), write_payload("one"))
    second, _ = store.produce(StageRequest("toy", 1, ToyConfig(2), [first.as_input()], {}), write_payload("two"))
    made = second.path.resolve()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    chain = Artifact.open(made).lineage()
    assert [a.key for a in chain] == [second.key, first.key]
