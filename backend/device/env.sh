# Device side (the lent H200, no registry): `source backend/device/env.sh` from the repo root
# after a call that carried .gpu-kit and .gpu-wheels (backend/device/prepare.sh builds them).
# Unpacks CuTe DSL, installs the carried wheels into /tmp/k3ft-site and puts both, the kit's
# fla-core and the repo on PYTHONPATH. Idempotent within one machine's life.
if [ ! -f .gpu-kit/cutedsl-4.8.1-cu13-cp312.tar.xz ]; then
  echo "env.sh: .gpu-kit is missing: run backend/device/prepare.sh here and carry .gpu-kit" >&2
  return 1 2>/dev/null || exit 1
fi
if [ ! -d .gpu-site/nvidia_cutlass_dsl ]; then
  mkdir -p .gpu-site && tar xJf .gpu-kit/cutedsl-4.8.1-cu13-cp312.tar.xz -C .gpu-site
fi
# prepare.sh packs the kit's fla-core folder as fla.tar.xz (4.6 MB of sources -> 0.4 MB) so the
# kit, the wheels and the tree fit one call's 64 MiB
if [ -f .gpu-kit/fla.tar.xz ] && [ ! -d .gpu-site/fla ]; then
  tar xJf .gpu-kit/fla.tar.xz -C .gpu-site
fi
if [ -d .gpu-wheels ] && [ ! -d /tmp/k3ft-site/pydantic ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/k3ft-site \
    .gpu-wheels/*.whl
fi
export PYTHONPATH=$PWD/.gpu-site/nvidia_cutlass_dsl/dsl_packages:$PWD/.gpu-site:$PWD/.gpu-kit:$PWD:/tmp/k3ft-site${PYTHONPATH:+:$PYTHONPATH}
