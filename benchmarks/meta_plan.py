"""Planning a full-size model on the meta device: wall time and peak memory.

The question (issue #10, part 4): can a user see how the default-size Llama (about 6.7B
parameters, 32 layers, width 4096) splits into 8 stages without the 27 GB of float32
weights? Two contenders, each run in a fresh Python process (so peak RSS is that process's
own, imports included):

* ``reference``: what building the same model on meta costs in plain transformers --
  ``AutoConfig.for_model('llama', use_cache=False)`` and ``AutoModelForCausalLM.from_config``
  under ``torch.device('meta')``. Every planning tool pays at least this.
* ``fxpipe``: the whole command ``fxpipe plan hf:llama --stages 8`` (through
  ``fxpipe.cli._main.main``): the same build, then capture (torch.export, traced as on the CPU),
  the untimed sizing run on meta, the partition (``balance_by='params'``), and printing
  the plan. Nothing is allocated for the weights.

Measured per run: wall seconds of the work in the child (``time.perf_counter`` around it,
imports of torch/transformers excluded and reported apart), and the child's peak resident set
size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``, which includes the imports). ``--repeat``
runs each (default 3), alternating; medians are reported. The plan printed by the last
fxpipe run goes to ``results/meta_plan.txt``.

Usage::

    .venv/bin/python benchmarks/meta_plan.py                 # default-size Llama, 8 stages
    .venv/bin/python benchmarks/meta_plan.py --repeat 5 --set num_hidden_layers=16
    python benchmarks/meta_plan.py --quick --device cuda     # 1 run, 8 layers, stages on cuda

``--device cuda`` computes nothing on the GPU (the model stays on meta): it is passed to
``fxpipe plan --device cuda``, so the plan is made for CUDA stages (it charges activation
transfers between stages, which a CPU plan does not) and needs a CUDA device to be present.
The reference contender does not depend on it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _child(which: str, stages: int, overrides: list[str], device: str = "cpu") -> dict:
    t0 = time.perf_counter()
    import torch
    import transformers

    imported = time.perf_counter() - t0
    out = io.StringIO()
    t1 = time.perf_counter()
    if which == "reference":
        settings = {"use_cache": False}
        for item in overrides:
            key, _, value = item.partition("=")
            settings[key] = json.loads(value)
        config = transformers.AutoConfig.for_model("llama", **settings)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        params = sum(p.numel() for p in model.parameters())
        rc = 0
    else:
        from fxpipe.cli._main import main

        argv = ["plan", "hf:llama", "--stages", str(stages), "--device", device]
        argv += [a for o in overrides for a in ("--set", o)]
        with contextlib.redirect_stdout(out):
            rc = main(argv)
        params = None
    wall = time.perf_counter() - t1
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"which": which, "rc": rc, "wall_s": wall, "import_s": imported, "peak_rss_mib": rss_mib,
            "params": params, "plan": out.getvalue()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--quick", action="store_true", help="one run of each, num_hidden_layers=8 unless --set")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="the stages' devices in fxpipe's plan (cuda: transfer-aware plan; nothing runs on it)")
    ap.add_argument("--child", choices=("reference", "fxpipe"), help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child:
        print(json.dumps(_child(ns.child, ns.stages, ns.set, ns.device)))
        return
    if ns.quick:
        ns.repeat, ns.set = 1, ns.set or ["num_hidden_layers=8"]
    if ns.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    runs: dict[str, list[dict]] = {"reference": [], "fxpipe": []}
    for r in range(ns.repeat):
        for which in runs:
            cmd = [sys.executable, __file__, "--child", which, "--stages", str(ns.stages), "--device", ns.device]
            cmd += [a for o in ns.set for a in ("--set", o)]
            res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            run = json.loads(res.stdout.strip().splitlines()[-1])
            if run["rc"] != 0:
                raise SystemExit(f"fxpipe plan failed: {res.stderr}")
            runs[which].append(run)
            print(f"run {r + 1} {which:9s} wall {run['wall_s']:6.2f} s  peak RSS {run['peak_rss_mib']:7.1f} MiB",
                  flush=True)
    import torch
    import transformers

    summary = {}
    for which, rs in runs.items():
        summary[which] = {k: statistics.median(x[k] for x in rs) for k in ("wall_s", "import_s", "peak_rss_mib")}
    summary["params"] = runs["reference"][0]["params"]
    print(f"\nLlama ({summary['params'] / 1e9:.2f}B parameters{', ' + ', '.join(ns.set) if ns.set else ''}) "
          f"on meta, {ns.stages} stages, median of {ns.repeat}:")
    print("| contender | wall s | peak RSS MiB | import s |")
    print("|---|--:|--:|--:|")
    for which in runs:
        s = summary[which]
        print(f"| {which} | {s['wall_s']:.2f} | {s['peak_rss_mib']:.0f} | {s['import_s']:.2f} |")
    plan = runs["fxpipe"][-1]["plan"]
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    tag = ("" if ns.device == "cpu" else "-cuda") + ("-quick" if ns.quick else "")
    with open(os.path.join(HERE, "results", f"meta_plan{tag}.txt"), "w") as f:
        f.write(plan)
    record = {
        "benchmark": "meta_plan", "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/meta_plan.py " + " ".join(sys.argv[1:]),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "stages": ns.stages, "overrides": ns.set, "repeat": ns.repeat, "device": ns.device,
        "medians": summary, "runs": [{k: v for k, v in x.items() if k != "plan"} for rs in runs.values() for x in rs],
    }
    with open(os.path.join(HERE, "results", f"meta_plan{tag}.json"), "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote benchmarks/results/meta_plan{tag}.json and meta_plan{tag}.txt")


if __name__ == "__main__":
    main()
