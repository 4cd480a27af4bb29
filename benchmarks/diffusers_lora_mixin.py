"""diffusers' own LoRA test mixin (``PeftLoraLoaderMixinTests``, tests/lora/utils.py) on engine pipelines (issue 37).

Runs diffusers' ``StableDiffusionLoRATests`` (tests/lora/test_lora_layers_sd.py) and ``FluxLoRATests``
(tests/lora/test_lora_layers_flux.py) twice, each in its own process: as they are, on PyTorch (the baseline), and with
every pipeline they make turned into an sdtrt engine pipeline (ONNX Runtime, fp32): the dummy components each test
builds are saved as a pipeline folder, compiled once (export → simplify → build-ort, cached in a store), and each
test gets fresh stand-ins (``load_pipeline``) for its denoiser, text encoders and VAE. Prints test | PyTorch |
engines | reason, and writes the outcomes as JSON.

    git -C <diffusers.git> archive 4e0466f3e5 tests | tar x -C /tmp/difftests
    python benchmarks/diffusers_lora_mixin.py --diffusers-tests /tmp/difftests --commit 4e0466f3e5

``--diffusers-tests`` is a folder holding diffusers' ``tests/`` (run from it, never copied here). diffusers' tests
need packages sdtrt's ``dev`` extra lacks: ``pip install parameterized`` first (TEST_DEPENDENCIES). Use a checkout from
before diffusers#14268 (4e0466f3e5, 2026-08): that change moved ``FluxLoRATests`` to the pytest-style
``LoraTesterMixin`` and took ``PeftLoraLoaderMixinTests`` down to its SD tests.

What differs from diffusers' own run:
- On both sides (offline): the hub models the tests load (``peft-internal-testing/tiny-clip-text-2``,
  ``hf-internal-testing/tiny-random-t5``) are local models of the same shapes (HUB_SHAPES: those repos' configs as
  we recall them, not checked against the hub: CLIP 32 wide, 5 layers, 4 heads, MLP 37, projection 32; T5 d_model
  32, 5 layers, 4 heads, d_kv 8, d_ff 37) with random weights (seed 0) and sdtrt's offline preset tokenizers
  (byte-level CLIP, Unigram T5) for theirs.
- On engines only: ``check_if_lora_correctly_set`` (it looks for PEFT layers inside the module) is, for stand-ins
  only, ENGINE_CHECK: "an adapter the pipeline holds changes this network's engine". No PEFT layer is faked: tests
  that read PEFT layers or their weights out of a module (get_peft_model_state_dict, .scaling, …) fail on engines
  and are listed with that reason.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SUITES = {
    "sd": ("tests/lora/test_lora_layers_sd.py", "StableDiffusionLoRATests"),
    "flux": ("tests/lora/test_lora_layers_flux.py", "FluxLoRATests"),
}
HUB_SHAPES = {
    "peft-internal-testing/tiny-clip-text-2": dict(
        hidden_size=32, intermediate_size=37, num_hidden_layers=5, num_attention_heads=4, projection_dim=32,
        max_position_embeddings=77, hidden_act="gelu",
    ),
    "hf-internal-testing/tiny-random-t5": dict(
        d_model=32, d_ff=37, d_kv=8, num_heads=4, num_layers=5, relative_attention_num_buckets=8,
    ),
}  # fmt: skip
TEST_DEPENDENCIES = ("parameterized",)  # what diffusers' LoRA tests import beyond sdtrt[dev]
PASSED = ("passed", "xpassed")
ENGINE_CHECK = "stand-ins: an adapter the pipeline holds changes this network (PyTorch modules: diffusers' own check)"
# Why a test that passes on PyTorch does not on engines, by what its failure shows (first match wins).
REASONS = (
    ("You must pass at least one of", "saves the state dicts get_peft_model_state_dict(module) reads out of PEFT "
     "layers in the module; a stand-in has none, so they are empty"),
    ("get_peft_model_state_dict", "reads the adapter weights out of PEFT layers in the module "
     "(get_peft_model_state_dict); a stand-in has none"),
    ("use_dora", "DoRA: refused on engines (a learned magnitude per weight column), in one line"),
    ("lora_bias", "a LoRA bias: refused on engines, in one line"),
    ("delete_adapters adds or drives PEFT", "calls PEFT's delete_adapters on one network; engines take the "
     "pipeline's delete_adapters"),
    ("inject_adapter_in_model", "injects PEFT layers into the module itself (inject_adapter_in_model)"),
    (".scaling[", "reads PEFT's per-layer .scaling inside the text encoder"),
    ("didn't have any of the following attributes", "walks the transformer's blocks to change a weight inside a "
     "PEFT layer (lora_A[...].weight)"),
    ("lora_A[", "changes a weight inside a PEFT layer of the module (lora_A[...].weight)"),
    ("has no attribute 'down_blocks'", "walks the UNet's blocks to read PEFT layers' .scaling inside them"),
    ("is not a LoRA file sdtrt knows", "loads a state dict with no LoRA keys: diffusers logs it and loads nothing, "
     "sdtrt refuses it in one line"),
    ("per-block weights", "per-block adapter weights need PyTorch adapter layers; an engine takes one scale per "
     "network"),
    ("enable_layerwise_casting", "casts PyTorch weights layer by layer; an engine's precision is built in"),
    ("enable_group_offload", "group offloading moves PyTorch weights; an engine's stay on its device"),
    ("Lora not correctly set in text encoder", "save_pretrained + from_pretrained make a PyTorch pipeline from the "
     "saved folder, and the engine's adapter is not in it"),
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--diffusers-tests", type=Path, required=True, help="a folder holding diffusers' tests/")
    parser.add_argument("--suites", default="sd,flux", help="comma-separated: sd, flux")
    parser.add_argument("-k", default=None, help="pytest -k expression, to run some tests only")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/diffusers-lora-mixin.json"))
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "sdtrt-lora-mixin",
                        help="local hub substitutes, dummy pipeline folders and the engine store (reused)")  # fmt: skip
    parser.add_argument("--commit", default=None, help="the diffusers commit the tests are from, for the record")
    parser.add_argument("--reuse", action="store_true", help="tabulate the last run's outcomes (in --work) again")
    parser.add_argument("--run", choices=("pytorch", "engines"), help=argparse.SUPPRESS)  # one side, in a child
    parser.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    suites = [SUITES[s] for s in args.suites.split(",")]
    if args.run:
        run_side(args.run, args.diffusers_tests.resolve(), suites, args.k, args.work, args.report)
        return
    outcomes = {}
    for side in ("pytorch", "engines"):
        report = args.work / f"{side}.json"
        if args.reuse:
            outcomes[side] = json.loads(report.read_text())
            continue
        command = [sys.executable, __file__, "--run", side, "--diffusers-tests", str(args.diffusers_tests),
                   "--suites", args.suites, "--work", str(args.work), "--report", str(report)]  # fmt: skip
        command += ["-k", args.k] if args.k else []
        started = time.perf_counter()
        report.unlink(missing_ok=True)  # a file left by an earlier run is not this run's outcome
        child = subprocess.run(command, check=False)  # pytest exits 1 when tests fail: the report says which
        if not report.is_file():
            needs = ", ".join(TEST_DEPENDENCIES)
            sys.exit(f"the {side} run wrote no outcomes (exit code {child.returncode}, output above): pass diffusers' "
                     f"tests folder, and pip install what its tests import ({needs})")  # fmt: skip
        outcomes[side] = json.loads(report.read_text())
        print(f"{side}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    rows = table(outcomes["pytorch"], outcomes["engines"])
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {side: count(o) for side, o in outcomes.items()}
    passing = [r for r in rows if r["pytorch"] in PASSED]
    summary["passed on PyTorch and on engines"] = sum(r["engines"] in PASSED for r in passing)
    summary["passed on PyTorch only"] = sum(r["engines"] not in PASSED for r in passing)
    result = {
        "diffusers_tests": str(args.diffusers_tests), "diffusers_commit": args.commit,
        "suites": [f"{f}::{c}" for f, c in suites],
        "engines": "ONNX Runtime (CPU), fp32, every network an engine (sdtrt compile --target onnxruntime)",
        "substitutes": {hub: f"local random model, {shape}" for hub, shape in HUB_SHAPES.items()},
        "engine_check_if_lora_correctly_set": ENGINE_CHECK, "summary": summary, "tests": rows,
    }  # fmt: skip
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary), file=sys.stderr)


def table(pytorch: dict[str, dict[str, Any]], engines: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for test in sorted(pytorch.keys() | engines.keys()):
        torch_side, engine_side = pytorch.get(test, {}), engines.get(test, {})
        row = {"test": test, "pytorch": torch_side.get("outcome", "-"), "engines": engine_side.get("outcome", "-")}
        if row["pytorch"] != row["engines"]:
            message, marks = engine_side.get("message", ""), engine_side.get("traceback_marks", [])
            said = next((why for mark, why in REASONS if mark in message), None)  # the error itself, else its frames
            row["reason"] = said or next((why for mark, why in REASONS if mark in marks), message)
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    width = max(len(r["test"]) for r in rows)
    print(f"{'test':{width}} | PyTorch | engines | reason when engines differ")
    for row in rows:
        print(f"{row['test']:{width}} | {row['pytorch']:7} | {row['engines']:7} | {row.get('reason', '')}")


def count(outcomes: dict[str, dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome["outcome"]] = counts.get(outcome["outcome"], 0) + 1
    return counts


def run_side(side: str, tests: Path, suites: list[tuple[str, str]], k: str | None, work: Path, report: Path) -> None:
    """One side's run, in this process: diffusers' test modules imported from ``tests``, patched, run by pytest."""
    import importlib

    import pytest

    os.environ["HF_HUB_OFFLINE"] = "1"
    sys.path.insert(0, str(tests))  # diffusers' `tests` package before sdtrt's own
    sys.modules.pop("tests", None)
    work.mkdir(parents=True, exist_ok=True)
    substitutes = hub_substitutes(work / "hub")
    for file, name in suites:
        module = importlib.import_module(file.removesuffix(".py").replace("/", "."))
        cls = getattr(module, name)
        for attr in [a for a in vars_of(cls) if a.endswith("_id")]:
            if getattr(cls, attr) in substitutes:
                setattr(cls, attr, str(substitutes[getattr(cls, attr)]))
        if side == "engines":
            on_engines(cls, module, work)
    recorder = Recorder()
    selection = [f"{tests / file}::{name}" for file, name in suites]
    options = ["-q", "-p", "no:cacheprovider", "--rootdir", str(tests), *(["-k", k] if k else [])]
    pytest.main([*options, *selection], plugins=[recorder])
    report.write_text(json.dumps(recorder.outcomes, indent=2))


def vars_of(cls: type) -> list[str]:
    return sorted({a for c in cls.__mro__ for a in vars(c)})


class Recorder:
    """pytest plugin: each test's outcome and, for a failure, its message's first line."""

    def __init__(self) -> None:
        self.outcomes: dict[str, dict[str, Any]] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        name = report.nodeid.split("::", 1)[1]
        if report.when == "call" or (report.when == "setup" and not report.passed):
            entry = {"outcome": report.outcome}
            if hasattr(report, "wasxfail"):  # diffusers marks some tests xfail: say how they ended
                entry["outcome"] = "xfailed" if report.skipped else "xpassed"
            if report.failed or entry["outcome"] == "xfailed":
                entry |= failure(report)
            elif report.skipped:
                entry["message"] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
            self.outcomes[name] = entry


def failure(report: Any) -> dict[str, Any]:
    """The failure's first line, and the REASONS marks its traceback (test source included) shows."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = str(report.longrepr)
    return {"message": (crash.message if crash else text).splitlines()[0][:300],
            "traceback_marks": [mark for mark, _ in REASONS if mark in text]}  # fmt: skip


def hub_substitutes(folder: Path) -> dict[str, Path]:
    """hub id → a local folder with a model of the same shapes and a tokenizer (see the module's docstring)."""
    import torch
    from transformers import AutoTokenizer, CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from sdtrt.sources.models import resolve_model

    made = {}
    for hub, shape in HUB_SHAPES.items():
        target = folder / hub.replace("/", "--")
        made[hub] = target
        if (target / "config.json").is_file():
            continue
        clip = "clip" in hub
        tokenizer = AutoTokenizer.from_pretrained(
            resolve_model("tiny-flux").path / ("tokenizer" if clip else "tokenizer_2")
        )
        torch.manual_seed(0)
        if clip:
            config: Any = CLIPTextConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                         **shape)  # fmt: skip
            model: Any = CLIPTextModel(config)
        else:
            config = T5Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id, **shape)  # fmt: skip
            model = T5EncoderModel(config)
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)
    return made


def on_engines(cls: type, module: Any, work: Path) -> None:
    """Make ``cls``'s pipelines engine pipelines, and its (and its module's) LoRA check engine-aware."""
    original = cls.get_dummy_components
    store_root = work / "engines"

    def get_dummy_components(self: Any, *args: Any, **kwargs: Any) -> Any:
        components, text_config, denoiser_config = original(self, *args, **kwargs)
        return engine_components(self.pipeline_class, components, work, store_root), text_config, denoiser_config

    cls.get_dummy_components = get_dummy_components
    utils = sys.modules["tests.lora.utils"]  # where the mixin looks the check up
    pytorch_check = utils.check_if_lora_correctly_set

    def check_if_lora_correctly_set(model: Any) -> bool:
        from sdtrt.standins.base import EngineModule

        return engine_has_lora(model) if isinstance(model, EngineModule) else pytorch_check(model)

    for holder in (utils, module):
        holder.check_if_lora_correctly_set = check_if_lora_correctly_set


def engine_components(pipeline_class: Any, components: dict[str, Any], work: Path, store_root: Path) -> dict:
    """The test's components with its networks replaced by engine stand-ins (compiled once per weights)."""
    import hashlib
    from dataclasses import replace

    import torch

    from sdtrt.core.config import ExportConfig, Range
    from sdtrt.core.store import Store
    from sdtrt.pipeline.loading import load_pipeline
    from sdtrt.sources.models import resolve_model
    from sdtrt.spec import denoiser_spec
    from sdtrt.standins.base import EngineModule
    from sdtrt.tools.compile import compile_model

    digest = hashlib.sha256()
    for name, part in sorted(components.items()):
        if isinstance(part, torch.nn.Module):
            for key, tensor in part.state_dict().items():
                digest.update(f"{name}.{key}".encode() + tensor.detach().cpu().float().numpy().tobytes())
    folder = work / "pipelines" / f"{pipeline_class.__name__}-{digest.hexdigest()[:16]}"
    if not (folder / "model_index.json").is_file():
        pipeline_class(**components).save_pretrained(folder)
    model = resolve_model(str(folder))
    built = ENGINES.get(folder)
    if built is None:
        default = denoiser_spec(model).default_profile()  # Flux's tests ask for 8×8 images: below its minimum
        sizes = {side: Range(TEST_MIN_PX, rng.opt, rng.max) for side, rng in (("height", default.height),
                                                                              ("width", default.width))}  # fmt: skip
        fp32 = ExportConfig(precision="fp32")
        built = compile_model(model, Store(store_root), "onnxruntime", fp32, profile=replace(default, **sizes)).final
        ENGINES[folder] = built
    engine_pipe = load_pipeline(model, built)
    standins = {name: part for name, part in engine_pipe.components.items() if isinstance(part, EngineModule)}
    if not {"unet", "transformer"} & set(standins):  # the measurement is void unless the denoiser is an engine
        raise RuntimeError(f"{folder}: the denoiser did not load as an engine ({sorted(standins)})")
    return {**components, **standins}


TEST_MIN_PX = 8  # the smallest image the tests make (Flux's 8×8)
ENGINES: dict[Path, Any] = {}  # pipeline folder → its engine set, in this process


def engine_has_lora(model: Any) -> bool:
    """ENGINE_CHECK: an adapter the pipeline holds changes this stand-in's network."""
    from sdtrt.standins.adapter_registry import engine_networks, registry
    from sdtrt.standins.peft_adapters import pipeline_of

    pipe = pipeline_of(model)
    state = registry(pipe) if pipe is not None else None
    if state is None:
        return False
    component = next(c for c, n in engine_networks(pipe).items() if n is model)
    return any(component in parts for parts in state.parts.values())


if __name__ == "__main__":
    main()
