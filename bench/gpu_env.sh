# Sourced by bench/gpu.sh on the device machine: the mlx-cuda wheels (made by
# ../shared/tools/mlx-cuda-wheels.sh, the first part copied to /root/stash by an earlier call, the
# second carried as .dev/b) installed into /root/site, and PYTHONPATH pointing there and here.
mkdir -p /root/stash "$OUT"
cp .dev/b/* /root/stash/
( cd /root/stash && cat cuda.part.* > mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl \
  && python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site \
     mlx-*.whl mlx_cuda_13-*.whl mlx_lm-*.whl ) || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1
