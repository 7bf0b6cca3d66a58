"""``python -m hvdtrain.bench``: run the comparisons side by side, write JSON, Markdown, PNGs.

python -m hvdtrain.bench                       # every case (about 16 minutes on 2 cores,
                                               # plus keras_speed's 36 launches and
                                               # pipeline's 6: about 42 more, and
                                               # models' 69: about 30 minutes more,
                                               # models_np1's 54: about 15 minutes)
python -m hvdtrain.bench --quick               # the headline cases, smaller: allreduce,
                                               # throughput, tta, fit (a few minutes;
                                               # the time is printed at the end)
python -m hvdtrain.bench --smoke --cases fit   # each case at its smallest, on the bundled
                                               # 4,000-digit sample: checks that it runs,
                                               # its numbers mean nothing (the tests')
python -m hvdtrain.bench --cases allreduce,tta --out /tmp/b
python -m hvdtrain.bench --cases models --models mlp   # one model users train
python -m hvdtrain.bench --cases models --variants task,tape   # two paths (and one process)
python -m hvdtrain.bench --cases models_np1            # the same, one process, both Keras
python -m hvdtrain.bench project --model resnet50      # projected scaling on GPU clusters
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time

from hvdtrain import bench
from hvdtrain.bench import cases, fit_cases, model_cases, projection, report, sparse_case
from hvdtrain.distributed import usable_cores

CASES = (
    "allreduce",
    "throughput",
    "steps",
    "tta",
    "timeline",
    "fit",
    "keras_speed",
    "pipeline",
    "sparse",
    "models",
    "models_np1",
)
MODELS = ("resnet", "bert", "mlp")  # the models case's models (model_workers.SHAPES)
# --quick without --cases: the comparisons docs/performance/index.md leads with (Horovod's
# allreduce, training throughput against plain TensorFlow and MultiWorkerMirroredStrategy,
# time to accuracy, the fit path against Horovod's Keras wrapper).
QUICK_CASES = ("allreduce", "throughput", "tta", "fit")
KIB = 1024


# Per-rank batches of the models case at full size: a step of 0.1-1 s on one core here
# (ResNet-50 at 32x32: 16 images, 0.65 s; the encoder: 8 sequences of 128, 0.26 s; the MLP:
# 32, 0.14 s), so that an epoch of a few steps measures steps, not the host.
MODEL_BATCHES = {"resnet": 16, "bert": 8, "mlp": 32}


def settings(level: str) -> dict:
    """What each case measures at ``level`` ("full", "quick" or "smoke"). The models are
    hvdtrain's: the seed's softmax regression and the mlp with a wider hidden layer
    (784 -> 1024 -> 10, 0.8 M parameters, 3.2 MB of gradients per step)."""
    softmax = {
        "label": "softmax",
        "model": "softmax",
        "hidden_units": 256,
        "lr": 0.5,
        "dataset": "fashion_mnist",
    }
    mlp = {
        "label": "mlp-1024",
        "model": "mlp",
        "hidden_units": 1024,
        "lr": 0.05,
        "dataset": "fashion_mnist",
    }
    if level == "smoke":  # every launch of a case once, as small as it goes: 4,000 digits
        softmax, mlp = (dict(s, dataset="mnist") for s in (softmax, mlp))
        return {
            "sizes": [4 * KIB, 64 * KIB],
            "scale": 0.05,
            "specs": [softmax],
            "batches": [1000],
            "epochs": 2,
            "repeats": 1,
            "tta": (softmax, 500, 0.5, 2),
            "timeline": (softmax, 500, 1),
            "fit": (250, 2, 1),
            "steps": ([softmax], 500, 2, (1, 0), 1),
            "keras_speed": (500, 2, 1, (8,), ("k3",), 64, 4, 3),
            "pipeline": (250, 2, 1),
            "sparse": (20_000, 8, 16, 3),
            "dataset": "mnist",
            # models: size, per-rank batches, steps per epoch, epochs, repeats
            "models": ("smoke", {"resnet": 4, "bert": 4, "mlp": 8}, 3, 2, 1),
        }
    if level == "quick":
        return {
            "sizes": [4 * KIB, 256 * KIB, 4 << 20],
            "scale": 0.2,
            "specs": [softmax],
            "batches": [4096],
            "epochs": 3,
            "repeats": 1,
            "tta": (softmax, 512, 0.80, 4),
            "timeline": (softmax, 512, 2),
            "fit": (256, 3, 1),
            "steps": ([softmax], 256, 3, (1, 16, 0), 1),
            "keras_speed": (256, 2, 1, (64,), ("k3",), 256, 100, 12),
            "pipeline": (64, 3, 1),
            "sparse": (1_000_000, 16, 64, 10),
            "models": ("full", MODEL_BATCHES, 16, 2, 2),
        }
    return {
        "sizes": [4 * KIB << (2 * i) for i in range(8)],
        "scale": 1.0,  # 4 KiB .. 64 MiB
        "specs": [softmax, mlp],
        "batches": [256, 1024, 4096],
        "epochs": 3,
        "repeats": 2,
        "tta": (softmax, 512, 0.80, 6),
        "timeline": (softmax, 512, 2),
        "fit": (64, 4, 2),  # model.fit: batch per rank, epochs, repeats
        # --steps-per-execution sweep: models, global batch, epochs, values, repeats
        "steps": ([softmax, mlp], 256, 3, (1, 4, 16, 64, 0), 2),
        # issue 17's Keras targets: global batch, epochs, repeats (softmax epochs are
        # short: 0.05-0.5 s, hence more epochs, the fastest counting); quick:
        # steps_per_execution 64 only, Keras 3 only for the one-process pair and the
        # paired fits, a smaller BN mlp, 12 paired epochs (full: 30)
        "keras_speed": (256, 6, 2),
        # issue 18's pipeline targets: batch per rank, epochs, repeats (mlp-256, 8 files)
        "pipeline": (64, 4, 2),
        # an Embedding's gradient gathered and dense: table rows, columns, batch per
        # rank, steps (the dense one: 64 MB allreduced a step)
        "sparse": (1_000_000, 16, 64, 20),
        # the models users train: per-rank batches, 16 steps an epoch (at 4, an epoch's
        # own work, 20 ms on the Task path, was 5 % of a one-process epoch), 3 epochs (the
        # first traces: ResNet-50's takes 20 s on one core), 3 repeats (this machine: +-30 %)
        "models": ("full", MODEL_BATCHES, 16, 3, 3),
    }


def plan(argv=None) -> argparse.Namespace:
    """The command line read: its flags, plus ``chosen`` (the cases to run, in order),
    ``level`` ("full", "quick" or "smoke") and ``out`` (the output directory, absolute).
    Exits 2 with one line on an unknown case, as argparse does on a bad flag."""
    p = argparse.ArgumentParser(prog="python -m hvdtrain.bench", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench-out", help="output directory (default: bench-out)")
    level = p.add_mutually_exclusive_group()
    level.add_argument(
        "--quick",
        action="store_true",
        help=f"smaller settings, and by default only {','.join(QUICK_CASES)}: "
        "a few minutes on 2 cores",
    )
    level.add_argument(
        "--smoke",
        action="store_true",
        help="each case at its smallest on the bundled 4,000-digit sample: "
        "checks that the cases run; the numbers mean nothing",
    )
    p.add_argument(
        "--cases",
        help=f"comma-separated subset of {','.join(CASES)} (default: "
        f"all; with --quick, {','.join(QUICK_CASES)})",
    )
    p.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"the models cases' models, comma-separated subset of {','.join(MODELS)}",
    )
    p.add_argument(
        "--variants",
        default=",".join(model_cases.VARIANTS),
        help="the models case's variants, comma-separated subset of "
        f"{','.join(model_cases.VARIANTS)} (default: all; one always runs: the others' "
        "reference)",
    )
    p.add_argument(
        "--sizes",
        type=lambda v: [int(x) for x in v.split(",")],
        help="allreduce sizes in bytes, comma-separated (default: 4 KiB to 64 MiB)",
    )
    args = p.parse_args(argv)
    cases_arg = args.cases or ",".join(QUICK_CASES if args.quick else CASES)
    args.chosen = [c.strip() for c in cases_arg.split(",") if c.strip()]
    unknown = set(args.chosen) - set(CASES)
    if unknown:
        p.error(f"--cases: unknown {', '.join(sorted(unknown))}; choose from {', '.join(CASES)}")
    args.models = _names(p, "--models", args.models, MODELS)
    args.variants = _names(p, "--variants", args.variants, model_cases.VARIANTS)
    args.out = os.path.abspath(args.out)
    args.level = "smoke" if args.smoke else "quick" if args.quick else "full"
    return args


def _names(p, flag, raw, choices) -> list:
    """``raw``, a comma-separated list, as names; exits 2 with one line (argparse's error)
    when one is not in ``choices`` or none is given."""
    names = [n.strip() for n in raw.split(",") if n.strip()]
    if set(names) - set(choices) or not names:
        p.error(f"{flag}: unknown {names}; choose from {', '.join(choices)}")
    return names


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["project"]:  # the projection to GPU clusters: no launches
        return projection.main(argv[1:])
    args = plan(argv)
    chosen, out, level = args.chosen, args.out, args.level
    os.makedirs(os.path.join(out, "raw"), exist_ok=True)
    s = settings(level)
    s["sizes"] = args.sizes or s["sizes"]
    fit_cases.DATASET = s.get("dataset", fit_cases.DATASET)
    command = "python -m hvdtrain.bench " + " ".join(shlex.quote(a) for a in argv)
    results = {
        "command": command,
        "quick": args.quick,
        "level": level,
        "started": time.strftime("%F %T"),
        "machine": f"{platform.node()}: {usable_cores()} cores, "
        f"{platform.processor() or platform.machine()}, Python "
        f"{platform.python_version()}",
    }
    tick = time.perf_counter()
    try:
        results["core_speed"] = bench.core_speed()
        bench.progress(
            "single core: " + ", ".join(f"{k} {v:.1f}" for k, v in results["core_speed"].items())
        )
        for case in chosen:
            bench.progress(f"case {case} ...")
            if case == "allreduce":
                results[case] = cases.allreduce(out, s["sizes"], s["scale"])
            elif case == "throughput":
                results[case] = cases.throughput(
                    out, s["specs"], s["batches"], s["epochs"], s["repeats"]
                )
            elif case == "steps":
                results[case] = cases.steps_per_call(out, *s["steps"])
            elif case == "tta":
                results[case] = cases.tta(out, *s["tta"])
            elif case == "timeline":
                results[case] = cases.timeline(out, *s["timeline"])
            elif case == "fit":
                results[case] = fit_cases.fit(out, *s["fit"])
            elif case == "keras_speed":
                results[case] = fit_cases.keras_speed(out, *s["keras_speed"])
            elif case == "pipeline":
                results[case] = fit_cases.pipeline(out, *s["pipeline"])
            elif case == "sparse":
                results[case] = sparse_case.sparse(out, *s["sparse"])
            elif case == "models":
                size, batches, steps, epochs, repeats = s["models"]
                results[case] = model_cases.models(
                    out,
                    args.models,
                    size,
                    batches,
                    steps,
                    epochs,
                    repeats,
                    timeline_apart=level != "smoke",
                    variants=args.variants,
                )
            elif case == "models_np1":  # the models case's settings, one process each
                size, batches, steps, epochs, repeats = s["models"]
                results[case] = model_cases.alone(
                    out, args.models, size, batches, steps, epochs, repeats
                )
    except bench.BenchError as e:
        print(f"python -m hvdtrain.bench: error: {e}", file=sys.stderr)
        return 1
    results["seconds"] = time.perf_counter() - tick
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = report.markdown(results, command)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    made = report.plots(results, out)
    print(text)
    bench.progress(
        f"done in {results['seconds']:.0f}s: {out}/results.json, results.md"
        + "".join(f", {os.path.basename(m)}" for m in made)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
