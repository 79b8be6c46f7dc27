#!/bin/bash
# Builds .gpuenv/: what the GPU machine lacks to serve and benchmark, small enough
# to travel with a device call (carry [".gpuenv"], about 40 MB):
#
#   triton.tar.xz        tritonserver 2.51, the Python backend and the Python 3.12 stub,
#                        cut from the nvidia-pytriton 0.7.0 wheel in .venv (`make setup`)
#   tritonclient.tar.gz  the tritonclient 2.51 package from .venv
#   *.whl                perf_analyzer 2.60.0 and, for Python 3.12, python-rapidjson and
#                        the HTTP client's gevent stack (downloaded from PyPI)
#   cuda-python.tar.xz   cuda-python 12.6 for Python 3.12 (tritonclient's CUDA shared memory),
#                        its compiled modules only: the wheel is 24 MB, this 11 MB
#   nginx.tar.xz         this machine's nginx (Debian's, `make setup`) with the libraries it links
#                        but libc, and a wrapper that runs it with them: the nginx guard's cost on
#                        the GPU host (`GUARDS="python nginx none" bash dev/gpu_checks.sh guardcost`)
#   setup_env.sh         `source .gpuenv/setup_env.sh` on the GPU machine: unpacks all of
#                        it under /tmp and sets PYTHONPATH and OPARA_ADMIN_KEY
#
# The machine's own numpy (2.x) is left alone: the Python stub ignores PYTHONPATH, and
# opara_core's adapter passes tensors through DLPack, which works with any numpy.
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
out=.gpuenv
rm -rf "$out" && mkdir -p "$out"

# nvidia_pytriton.libs without its libpython 3.13 (the 3.12 stub uses the machine's own)
XZ_OPT=-9 tar -C "$site" --exclude='libpython3-*' -cJf "$out/triton.tar.xz" \
    pytriton/__init__.py pytriton/tritonserver/bin/tritonserver \
    pytriton/tritonserver/backends/python/libtriton_python.so \
    pytriton/tritonserver/backends/python/triton_python_backend_utils.py \
    pytriton/tritonserver/caches pytriton/tritonserver/python_backend_stubs/3.12 nvidia_pytriton.libs
tar -C "$site" --exclude=__pycache__ -czf "$out/tritonclient.tar.gz" tritonclient

.venv/bin/pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --platform manylinux_2_38_x86_64 -d "$out" perf-analyzer==2.60.0
.venv/bin/pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux1_x86_64 -d "$out" \
    python-rapidjson geventhttpclient gevent greenlet zope.event zope.interface brotli certifi six \
    "$(grep -o 'uvloop==[^"]*' pyproject.toml)"

tmp=$(mktemp -d)
.venv/bin/pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 -d "$tmp" "$(grep -o 'cuda-python==[^"]*' pyproject.toml)"
(cd "$tmp" && python3 -m zipfile -e cuda_python-*.whl unpacked)
XZ_OPT=-9 tar -C "$tmp/unpacked" --exclude='*.cpp' --exclude='*.pyx' --exclude='*.pxd' --exclude='*.h' \
    -cJf "$out/cuda-python.tar.xz" cuda
rm -rf "$tmp"

nginx=$(command -v nginx || echo /usr/sbin/nginx)
tmp=$(mktemp -d)
mkdir -p "$tmp/nginx/bin" "$tmp/nginx/lib"
cp "$nginx" "$tmp/nginx/lib/nginx"
ldd "$nginx" | awk '$3 ~ /^\// {print $3}' | grep -v '/libc\.so' | xargs -I{} cp -L {} "$tmp/nginx/lib/"
cat >"$tmp/nginx/bin/nginx" <<'EOF'
#!/bin/sh
# Debian's nginx with the libraries it was built against (dev/make_gpuenv.sh)
lib=$(dirname "$(dirname "$(readlink -f "$0")")")/lib
LD_LIBRARY_PATH=$lib exec "$lib/nginx" "$@"
EOF
chmod +x "$tmp/nginx/bin/nginx"
XZ_OPT=-9 tar -C "$tmp" -cJf "$out/nginx.tar.xz" nginx
rm -rf "$tmp"

cat >"$out/setup_env.sh" <<'EOF'
# source me on the GPU machine, in the repository root (made by dev/make_gpuenv.sh)
if [ ! -d /tmp/site/pytriton ]; then
  mkdir -p /tmp/site /tmp/pa /tmp/tc
  tar -C /tmp/site -xJf .gpuenv/triton.tar.xz
  pip install -q --no-index --no-deps --target /tmp/pa .gpuenv/perf_analyzer-*.whl 2>/dev/null
  pip install -q --no-index --no-deps --target /tmp/tc .gpuenv/python_rapidjson-*.whl .gpuenv/gevent*.whl \
    .gpuenv/greenlet-*.whl .gpuenv/zope*.whl .gpuenv/brotli-*.whl .gpuenv/certifi-*.whl .gpuenv/six-*.whl \
    .gpuenv/uvloop-*.whl 2>/dev/null
  tar -C /tmp/tc -xzf .gpuenv/tritonclient.tar.gz
fi
if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ] && [ ! -d /tmp/nginx ]; then
  tar -C /tmp -xJf .gpuenv/nginx.tar.xz
fi
[ -d /tmp/nginx ] && export PATH=/tmp/nginx/bin:$PATH
if [ ! -d /tmp/cudapy/cuda ]; then
  mkdir -p /tmp/cudapy && tar -C /tmp/cudapy -xJf .gpuenv/cuda-python.tar.xz
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:/tmp/tc:$PWD OPARA_ADMIN_KEY=gpu-session-admin-key-0123
# cuda-python 12.6 only where the machine has no `cuda.cudart` of its own (on PYTHONPATH it
# would shadow any `cuda` package of the machine's, e.g. cuda-bindings 13)
python3 -c "from cuda import cudart" 2>/dev/null || export PYTHONPATH=$PYTHONPATH:/tmp/cudapy
export PERF_ANALYZER=/tmp/pa/perf_analyzer/bin/perf_analyzer
EOF
du -sh "$out"
