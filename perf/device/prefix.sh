# Sourced at the start of every device call (see perf/RUNBOOK.md): multicast off,
# diffusers from the carried wheels, weightstream installed editable without network.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export WEIGHTSTREAM_COMMIT=${WEIGHTSTREAM_COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || { echo "wheel install failed"; return 9; }
if ! python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > "${OUT:-/tmp}/pip-install.log" 2>&1; then
  echo "editable install failed:"; tail -20 "${OUT:-/tmp}/pip-install.log"; return 8
fi
python3 - <<'PY'
import setuptools, torch, triton
print("setuptools", setuptools.__version__, "| torch", torch.__version__, "| triton", triton.__version__,
      "| gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PY
