"""Benchmark scenarios, the regression harness and its baselines.

Run from the repository root:

    python -m perf run --scenario flux-12b-1024 --modes resident,layerwise,diffusers-block,diffusers-leaf
    python -m perf check perf/results/<scenario>-<gpu>-<commit>.json
    python -m perf baseline perf/results/<scenario>-<gpu>-<commit>.json

Each mode runs in a fresh subprocess (`python -m perf _worker ...`); see
perf/harness.py. Results follow DESIGN.md section 7 (perf/results.py checks them).
"""
