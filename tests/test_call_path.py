"""Following compile_model's ``model`` through the calls goes down the layers.

Imports only go down (tests/test_layers.py), so a call can climb to a higher layer only through a callback. This
traces a real compile (tiny's text encoder, a fresh store: every stage runs) and lists each call from one layer into
a higher one. The one such place by design: the store calls back the stage's build function on a cache miss
(``Store.produce``), so that the stage says what to build and the store when, where and under which lock.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import sdtrt
from sdtrt import Store, compile_model, resolve_model

from .test_layers import layer_of

PACKAGE = Path(sdtrt.__file__).parent
ALLOWED_CLIMBS = {"sdtrt.core.store.produce"}  # the store's build callback (see the module docstring)


def module_of(frame: Any) -> str | None:
    path = Path(frame.f_code.co_filename)
    if not path.is_relative_to(PACKAGE):
        return None
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@contextmanager
def climbs_recorded(model: Any) -> Iterator[list[tuple[str, str, bool]]]:
    """(caller, callee, whether the callee received ``model``) for each sdtrt call into a higher layer."""
    found: list[tuple[str, str, bool]] = []

    def profile(frame: Any, event: str, _: Any) -> None:
        if event != "call" or (callee := module_of(frame)) is None:
            return
        caller = frame.f_back
        while caller is not None and module_of(caller) is None:
            caller = caller.f_back
        if caller is None:
            return
        lower = module_of(caller)
        if layer_of(callee) > layer_of(lower):
            follows = any(v is model for v in frame.f_locals.values())
            found.append((f"{lower}.{caller.f_code.co_name}", f"{callee}.{frame.f_code.co_name}", follows))

    sys.setprofile(profile)
    try:
        yield found
    finally:
        sys.setprofile(None)


@pytest.mark.slow  # 42 s under sys.setprofile; tests/test_layers.py checks the same order statically on every run
def test_compile_models_path_climbs_only_through_the_stores_build_callback(tmp_path):
    model = resolve_model("tiny")
    with climbs_recorded(model) as climbs:
        result = compile_model(model, Store(tmp_path / "store"), "onnxruntime", components=("text_encoder",))
    assert [a.stage for a in result.artifacts] == ["export", "simplify", "build-ort"]
    callers = {caller for caller, _, _ in climbs}
    assert callers <= ALLOWED_CLIMBS, f"calls into a higher layer: {sorted(set(climbs))}"
    assert {callee.rsplit(".", 1)[0] for _, callee, _ in climbs} == {
        "sdtrt.stages.export",
        "sdtrt.stages.simplify",
        "sdtrt.stages.build_ort",
    }
    # Of them, only export's build receives the model itself: the one climb on the model's path.
    assert {callee for _, callee, follows in climbs if follows} == {"sdtrt.stages.export.<lambda>"}
