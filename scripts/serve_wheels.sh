#!/usr/bin/env bash
# Wheels of the serving stack (fastapi, uvicorn, the openai client and what they need) for a GPU
# machine that reaches no package index: the versions installed here, built for CPython
# $PY_VERSION (default 3.12) on x86-64 Linux, into .whl/ (ignored by git; carry it along).
# `scripts/gpu_check.sh serve` installs them from there when fastapi, uvicorn or openai is missing.
#   bash scripts/serve_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}
# name==version of every distribution these need on the target, from this environment's metadata
pins=$(PY_VERSION=$PY_VERSION python - <<'EOF'
import os
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement

py = os.environ["PY_VERSION"]
target = {"python_version": py, "python_full_version": py + ".0", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
pins, todo = {}, ["fastapi", "uvicorn", "openai", "httpx"]
while todo:
    name = todo.pop()
    try:
        dist = distribution(name)
    except PackageNotFoundError:
        raise SystemExit(f"error: {name} is not installed here: pip install '.[test]' first")
    key = dist.metadata["Name"].lower().replace("_", "-")
    if key in pins:
        continue
    pins[key] = dist.version
    for r in dist.requires or []:
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate(target):
            todo.append(req.name)
print(" ".join(f"{k}=={v}" for k, v in sorted(pins.items())))
EOF
)
mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
# shellcheck disable=SC2086  # one argument per pin
python -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  "${platforms[@]}" -d .whl $pins
echo "wheels in .whl/: $pins"
