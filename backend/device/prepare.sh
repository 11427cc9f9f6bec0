#!/usr/bin/env bash
# CPU side, once per machine: builds what a device call carries besides the working tree.
#   .gpu-kit/     CuTe DSL 4.8.1 (cu13) + fla-core for the H200's Python 3.12 (../shared's
#                 build-gpu-kit, about 5 minutes, ~53 MiB)
#   .gpu-wheels/  the pure-Python packages k3ft and pytest need there and the device image lacks
#                 (pydantic and its core for cp312, pytest and its deps), ~3 MiB
# Both are git-ignored; name them in the device call's `carry`, then on the device:
#   source backend/device/env.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
kit_builder=${GPU_KIT_BUILDER:-../shared/device/build-gpu-kit}
if [ ! -x "$kit_builder" ]; then
  echo "prepare: $kit_builder not found (set GPU_KIT_BUILDER to the kit's build script)" >&2
  exit 1
fi
[ -f .gpu-kit/fla.tar.xz ] && [ -f .gpu-kit/cutedsl-4.8.1-cu13-cp312.tar.xz ] || "$kit_builder" .gpu-kit
if [ -d .gpu-kit/fla ]; then   # env.sh unpacks it on the device
  tar cf - -C .gpu-kit fla | xz -6 > .gpu-kit/fla.tar.xz && rm -rf .gpu-kit/fla
fi
mkdir -p .gpu-wheels
plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
# pinned versions: the same wheels every device call installs
python3 -m pip download -q --no-deps $plat -d .gpu-wheels \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pygments==2.21.0 \
  pytest-xdist==3.8.0 execnet==2.1.2
du -sh .gpu-kit .gpu-wheels
