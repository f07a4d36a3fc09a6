#!/usr/bin/env bash
# Wheels the GPU machine cannot download (it has no network), into .whl/ (git-ignored), for `carry`:
# Liger-Kernel (a benchmark peer) and transformers with its dependencies (tests/torch/test_patch.py's
# real-model tests). The device image runs Python 3.12 and has numpy and torch already.
# tools/gpu_suite.sh installs everything in .whl/ with --no-deps into /tmp/site.
set -eu
mkdir -p .whl
pip download -q --no-deps --only-binary=:all: liger-kernel==0.8.5 -d .whl
pip download -q --python-version 3.12 --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  transformers==5.23.0 -d .whl
# the device image has these (torch and pytest need them): keep its versions
rm -f .whl/numpy-*.whl .whl/filelock-*.whl .whl/fsspec-*.whl .whl/typing_extensions-*.whl .whl/packaging-*.whl
du -sh .whl
