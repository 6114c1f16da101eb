"""Benchmark scenarios, the regression harness and its baselines.

Run from the repository root:

    python -m perf list
    python -m perf run --scenario flux-12b-1024 --modes resident,layerwise,diffusers-block,diffusers-leaf
    python -m perf check perf/results/flux-12b-1024-nvidia-h200.json
    python -m perf baseline perf/results/flux-12b-1024-nvidia-h200.json

Results: one file per scenario and GPU kind, ``perf/results/<scenario>-<gpu kind>.json``,
holding the latest run of each mode. Single-GPU modes run each in a fresh subprocess
(perf/harness.py, perf/worker.py), DLO modes on ranks (perf/dlo.py), the module-swap
scenario in one process (perf/module_swap.py). Results follow DESIGN.md section 7
(perf/results.py checks them).
"""
