#!/usr/bin/env bash
# Container start: the first moment a GPU can be present (`docker build` steps get none). Runs NGC's own
# entrypoint first when the image has one (its banner and CUDA forward-compatibility setup), then imports
# TensorRT and torch-tensorrt for real and says in one line what is wrong if that fails, then runs the
# command either way, so a shell or `sdtrt --help` still works in a container without a GPU.
set -uo pipefail

ngc_entrypoint=/opt/nvidia/nvidia_entrypoint.sh
if [[ -x $ngc_entrypoint && -z ${SDTRT_NGC_ENTRYPOINT_DONE:-} ]]; then
  export SDTRT_NGC_ENTRYPOINT_DONE=1
  exec "$ngc_entrypoint" "$0" "$@"
fi

# torch_tensorrt calls torch.cuda.current_device() while it imports (docker/versions.py says where), so
# without a GPU its import fails with a traceback that does not say why: say it first.
check='
import sys, torch
if not torch.cuda.is_available():
    sys.exit("no NVIDIA GPU is visible: start the container with `docker run --gpus all …` (NVIDIA Container Toolkit)")
import tensorrt, torch_tensorrt
'
if ! error=$(python3 -c "$check" 2>&1); then
  echo "sdtrt: TensorRT commands will fail in this container: $(tail -n 1 <<<"$error")" >&2
fi

exec "$@"
