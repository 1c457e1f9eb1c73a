#!/usr/bin/env bash
# Packaging checks beyond the CTest ones (`ctest -L packaging`, part of every test run: install the
# CMake package exactly as the vcpkg port does with no CUDA compiler, then build consumers through
# find_package, add_subdirectory and FetchContent):
#   1. the vcpkg ports: valid manifests (name, version, dependencies) at the CMakeLists.txt version,
#      and a registry variant equal to the overlay port but for where the sources come from;
#   2. Conan 2: `conan create .` against the system CUDA Toolkit, with CONAN_HOME under build/.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/common.sh

echo "== vcpkg ports (manifests, registry variant)"
for manifest in ports/routing-replay/vcpkg.json ports/registry/routing-replay/vcpkg.json; do
  python3 -m json.tool "$manifest" >/dev/null || { echo "$manifest: invalid JSON"; exit 1; }
done
python3 - <<'PY'
import json, pathlib, re, sys

version = re.search(r"project\(routing_replay VERSION ([0-9.]+)",
                    pathlib.Path("CMakeLists.txt").read_text()).group(1)
overlay = pathlib.Path("ports/routing-replay")
registry = pathlib.Path("ports/registry/routing-replay")
errors = []

def configure_options(port):
    call = re.search(r"vcpkg_cmake_configure\(([^)]*)\)", (port / "portfile.cmake").read_text())
    return re.findall(r"-D[A-Za-z0-9_]+(?::[A-Z]+)?=[^\s)]*", call.group(1)) if call else []

for port in (overlay, registry):
    manifest = json.loads((port / "vcpkg.json").read_text())
    missing = {"name", "version", "dependencies"} - manifest.keys()
    if missing:
        errors.append(f"{port}/vcpkg.json lacks {sorted(missing)}")
        continue
    if manifest["name"] != "routing-replay" or manifest["version"] != version:
        errors.append(f"{port}/vcpkg.json: want routing-replay {version}, "
                      f"have {manifest['name']} {manifest['version']}")
    deps = {d if isinstance(d, str) else d["name"]: d for d in manifest["dependencies"]}
    if "cuda" not in deps:
        errors.append(f"{port}/vcpkg.json: no dependency on cuda")
    for helper in ("vcpkg-cmake", "vcpkg-cmake-config"):
        if not isinstance(deps.get(helper), dict) or deps[helper].get("host") is not True:
            errors.append(f"{port}/vcpkg.json: {helper} must be a host dependency")
    if not configure_options(port):
        errors.append(f"{port}/portfile.cmake: no vcpkg_cmake_configure OPTIONS")
    if not (port / "usage").is_file():
        errors.append(f"{port}: no usage file")

# The registry variant differs only in fetching a tagged release: past the marker, the portfiles
# are the same text, and so are the manifests and usage files.
def common_part(port):
    return (port / "portfile.cmake").read_text().partition("\n# ---- the same in the overlay")[2]
if not common_part(overlay) or common_part(registry) != common_part(overlay):
    errors.append("the portfiles differ past the '# ---- the same in the overlay' marker")
for name in ("vcpkg.json", "usage"):
    if (registry / name).read_bytes() != (overlay / name).read_bytes():
        errors.append(f"{registry}/{name} differs from {overlay}/{name}")

print("\n".join(errors) if errors else f"ok: routing-replay {version}, options {configure_options(overlay)}")
sys.exit(1 if errors else 0)
PY

echo "== Conan 2: conan create . (system CUDA Toolkit)"
pip_install conan conan
conan() { python3 -m conans.conan "$@"; }  # works wherever pip put the `conan` script
export CONAN_HOME="$PWD/build/conan/home"
out="$PWD/build/conan"
mkdir -p "$out"
[ -f "$CONAN_HOME/profiles/default" ] || conan profile detect --force >/dev/null 2>&1
# C++20 whatever the detected profile says.
if ! conan create . -s compiler.cppstd=20 >"$out/create.log" 2>&1; then
  cat "$out/create.log"; exit 1
fi
grep '^routing-replay:' "$out/create.log"
