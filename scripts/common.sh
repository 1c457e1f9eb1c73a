# Shared by the scripts in this folder: find the toolchain, install what a fresh machine lacks.
# Sourced, not run.

# nvcc lives outside PATH on some images
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null 2>&1; then sudo "$@"; else
    echo "need root to run: $*" >&2; return 1; fi
}

# apt_install PACKAGE...: installs the Debian packages that are missing (no-op when all are there).
apt_install() {
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "installing: ${missing[*]}"
  local log
  log=$(mktemp)
  if ! { as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive \
           apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
    cat "$log"; rm -f "$log"; return 1
  fi
  rm -f "$log"
}

# pip_install MODULE PACKAGE: installs a Python package unless the module already imports.
pip_install() {
  python3 -c "import $1" >/dev/null 2>&1 && return 0
  echo "installing Python package: $2"
  # Debian's python3 comes without pip
  python3 -m pip --version >/dev/null 2>&1 || apt_install python3-pip
  python3 -m pip install -q "$2" 2>/dev/null || python3 -m pip install -q --break-system-packages "$2"
}

build_jobs() { nproc 2>/dev/null || echo 2; }

# host_package_wheel: builds the package with the host module only (no CUDA module, whatever nvcc
# is there) into build/python-host-wheel and prints the wheel's path. One build serves every
# virtual environment of one Python (install it with `pip install --no-deps WHEEL`): the build
# tools live in a venv of their own (build/python-build-venv) and the CMake tree stays in
# build/python-host, so a second call only rebuilds what changed (ccache where it is installed).
host_package_wheel() {
  local tools="$PWD/build/python-build-venv" out="$PWD/build/python-host-wheel"
  if [ ! -x "$tools/bin/python" ]; then
    # python/pyproject.toml's build requirements (CCCL's headers serve only where no CUDA Toolkit
    # is installed), and CMake and Ninja where the machine has none or too old a CMake
    local extra=()
    cmake --version 2>/dev/null | awk 'NR == 1 { split($3, v, "."); exit !(v[1] > 3 || (v[1] == 3 && v[2] >= 25)) }' \
      || extra+=("cmake>=3.25")
    command -v ninja >/dev/null 2>&1 || extra+=(ninja)
    python3 -m venv "$tools" >&2
    "$tools/bin/pip" install -q scikit-build-core nanobind numpy nvidia-cuda-cccl "${extra[@]}" >&2
  fi
  local launcher=()
  if command -v ccache >/dev/null 2>&1; then
    launcher=(-C cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache)
  fi
  rm -rf "$out"
  "$tools/bin/pip" wheel -q --no-build-isolation --no-deps -w "$out" ./python \
    -C build-dir="$PWD/build/python-host" -C cmake.define.ROUTING_REPLAY_PYTHON_CUDA=OFF \
    -C "cmake.define.CMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG" "${launcher[@]}" >&2
  ls "$out"/routing_replay-*.whl
}
