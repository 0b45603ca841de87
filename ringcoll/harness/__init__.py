"""Running ringcoll on many processes: the launcher that starts P ranks with a process group
and reports every rank's outcome (launcher.py; the tests and the benchmark use it), the
checked benchmark behind ``ringcoll-bench`` (bench.py) and the hypothesis fuzzer (fuzz.py)."""
