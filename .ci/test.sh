#!/usr/bin/env bash
# The README's test command: install (CPU torch from the local wheel, then ringcoll with its
# test extras) and run the test suite. Any failure, or no test run, fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e ".[test]"
python -m pytest -q -p no:cacheprovider "$@"
