"""Turn the cases' results into the acceptance ratios, Markdown tables and PNG plots."""

from __future__ import annotations

import os

MIB = 1 << 20
KERAS = {"k2": "tf_keras", "k3": "Keras 3"}
# The acceptance rows whose ratio must stay at or under its threshold (the others: at least).
AT_MOST = ("softmax", "time", "allreduce", "BN", "process wall")


def table(header, rows) -> str:
    """A Markdown table; floats get 3 significant digits, None prints as '-'."""

    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def size_label(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // 1024} KiB"


def acceptance(results) -> list:
    """[(target, where, measured ratio, threshold, holds)] for every target the data covers."""
    checks = []

    def add(target, where, value, threshold, higher=True):
        if value is not None:
            checks.append(
                (
                    target,
                    where,
                    value,
                    threshold,
                    value >= threshold if higher else value <= threshold,
                )
            )

    tp = results.get("throughput")
    if tp:
        largest = max(r["global_batch"] for r in tp["rows"])
        for r in tp["rows"]:
            s, where = r["samples_per_sec"], f"{r['model']}, batch {r['global_batch']}"
            add("(b)/(a) throughput", where, s["b"] / s["a"], 0.97)
            add("(c)/(d) throughput", where, s["c"] / s["d"], 1.3)
            if r["model"].startswith("mlp") and r["global_batch"] == largest:
                add("(c) / 2x(b, 1 thread): scaling efficiency", where, s["c"] / (2 * s["b1"]), 0.9)
                add("(c)/(a) throughput", where, s["c"] / s["a"], 0.9)
            if "b_rank" in s:
                add(
                    "softmax step time (c) / (1 process, same per-rank batch)",
                    where,
                    r["step_ms"]["c"] / r["step_ms"]["b_rank"],
                    1.5,
                    higher=False,
                )
    ar = results.get("allreduce")
    if ar:
        hvd, ref = ar["series"]["hvd_mpi"], ar["series"]["mpi4py"]
        for h, m in zip(hvd, ref):
            if h["bytes"] >= 4 * MIB:
                add(
                    "hvd.allreduce (MPI) busbw / mpi4py",
                    size_label(h["bytes"]),
                    h["busbw"] / m["busbw"],
                    0.8,
                )
    tl = results.get("timeline")
    if tl and tl.get("steps"):
        # From the first step's round to the last's: every allreduce between counted (the
        # epochs' metric sums and checkpoints' checks among them); the run's start and end
        # (its agreement questions, the final scoring) are not per step.
        add(
            "allreduce negotiation rounds per training step (first step to last, all counted)",
            f"{tl['model']}, batch {tl['global_batch']}, {tl['steps']} steps",
            tl.get("training_rounds", tl["allreduce_rounds"]) / tl["steps"],
            1.05,
            higher=False,
        )
    tta = results.get("tta")
    if tta:
        rows = tta["rows"]
        b, c, d = (rows[v]["seconds"] for v in ("b", "c", "d"))
        if b and c:
            add(
                "time to accuracy: 2 processes / 1 process",
                f"{tta['model']} to {tta['target']}",
                c / b,
                1.0,
                higher=False,
            )
        if c and d:
            add(
                "time to accuracy: 2 processes / MWMS",
                f"{tta['model']} to {tta['target']}",
                c / d,
                1.0 - 1e-9,
                higher=False,
            )
        walls = tta.get("wall_ratios")
        if walls:  # issue 28: the whole process, launch to exit, the same job on both sides
            where = f"{tta['model']}, {tta.get('max_epochs')} epochs and the test set"
            add(
                "process wall: hvdtrain 2 processes / MWMS 2 workers",
                where,
                walls["c/d"],
                0.8,
                higher=False,
            )
            add(
                "process wall: hvdtrain 1 process / plain Keras 1 process",
                where,
                walls["b/k"],
                1.0,
                higher=False,
            )
    ks = results.get("keras_speed")
    if ks:
        r, batch = ks["ratios"], ks["global_batch"]
        for spe in ks["spes"]:
            add(
                "fit path, 2 processes: hk.fit / Horovod's Keras fit (tf_keras)",
                f"softmax, batch {batch}, tf_keras, steps_per_execution {spe}",
                r[f"fit_k2_spe{spe}"],
                1.0,
            )
        for spe in ks["spes"]:
            for tag in ks["kerases"]:
                if f"pair_{tag}_spe{spe}" in r:  # results from before the paired launches
                    add(
                        "fit path, 2 processes, epochs paired in the same processes: hk.fit / "
                        "Horovod's Keras fit",
                        f"softmax, batch {batch}, {KERAS[tag]}, steps_per_execution {spe}",
                        r[f"pair_{tag}_spe{spe}"],
                        1.0,
                    )
        for tag in ks["kerases"]:
            keras = KERAS[tag]
            add(
                "Task path, 1 process / one-process Keras fit, steps_per_execution 64",
                f"softmax, batch {batch}, {keras}",
                r[f"task1_{tag}"],
                1.0,
            )
        where = (
            f"mlp-{ks['bn_units']} + BN, batch {batch}, 2 processes, Keras 3, checkpoint "
            f"every {ks['bn_every']}"
        )
        add(
            "BN sync: its seconds / the training's seconds",
            where,
            r["bn_sync_share"],
            0.05,
            higher=False,
        )
        add(
            "BN sync: step time synced / unsynced - 1", where, r["bn_sync_cost"], 0.05, higher=False
        )
    pl = results.get("pipeline")
    if pl:
        where = (
            f"mlp-{pl['hidden_units']}, {pl['ranks']} processes, batch {pl['batch_per_rank']} "
            f"per rank, {pl['files']} files"
        )
        add(
            "hk.fit: TFRecord files through tf.data / arrays in memory",
            where,
            pl["ratios"]["tfrecord/arrays"],
            0.9,
        )
        add(
            "tf.data pipeline: hk.fit / MultiWorkerMirroredStrategy fit (auto-sharded)",
            where,
            pl["ratios"]["hk/mwms"],
            1.3,
        )
    for r in (results.get("models") or {}).get("rows", []):
        for pair, got in r.get("paired", {}).items():
            add(
                f"models, {r['ranks']} processes, paired by round: {pair}",
                f"{r['model']}, batch {r['batch_per_rank']} per rank",
                got[0],
                1.0,
            )
    for r in (results.get("models_np1") or {}).get("rows", []):
        keras = results["models_np1"]["kerases"][r["keras"]]
        for pair, got in r["paired"].items():
            add(
                f"models, 1 process, paired by round: {pair}",
                f"{r['model']}, batch {r['batch']}, {keras}",
                got[0],
                0.95,
            )
    return checks


def markdown(results, command: str) -> str:
    parts = [f"Command: `{command}`\n", f"Machine: {results['machine']}\n"]
    speed = results.get("core_speed")
    if speed:
        parts.append(
            f"Single-core speed (to compare machines, not variants): float32 matmul "
            f"{speed['matmul_gflops']:.1f} GFLOP/s, Python {speed['python_mops']:.1f} M "
            f"loop iterations/s, copy {speed['copy_gbps']:.1f} GB/s\n"
        )
    checks = acceptance(results)
    if checks:
        parts.append("### Acceptance ratios (one run, side by side)\n")
        parts.append(
            table(
                ["target", "where", "ratio", "needs", "holds"],
                [
                    (
                        t,
                        w,
                        v,
                        ("<= " if t.startswith(AT_MOST) else ">= ") + f"{th:.3g}",
                        "yes" if ok else "**no**",
                    )
                    for t, w, v, th, ok in checks
                ],
            )
        )
    ar = results.get("allreduce")
    if ar:
        names = list(ar["series"])
        parts.append(
            f"\n### Allreduce, {ar['ranks']} processes, float32 (busbw = algbw * 2(n-1)/n; "
            "memcpy: one-core copy bandwidth)\n"
        )
        rows = []
        for i, nbytes in enumerate(ar["sizes"]):
            s = {n: ar["series"][n][i] for n in names}
            rows.append(
                [size_label(nbytes)]
                + [s[n]["seconds"] * 1e6 for n in names]
                + [s[n]["busbw"] / 1e9 for n in names]
                + [s["hvd_mpi"]["busbw"] / s["mpi4py"]["busbw"]]
            )
        parts.append(
            table(
                ["size"]
                + [f"{n} us" for n in names]
                + [f"{n} GB/s" for n in names]
                + ["hvd_mpi/mpi4py"],
                rows,
            )
        )
    tp = results.get("throughput")
    if tp:
        parts.append(
            f"\n### Training throughput, samples/s (best of {tp['repeats']}, epochs 2-"
            f"{tp['epochs']})\n"
        )
        parts.append("".join(f"- {v}: {label}\n" for v, label in tp["variants"].items()))
        variants = list(tp["variants"])
        rows = []
        for r in tp["rows"]:
            s = r["samples_per_sec"]
            rows.append(
                [r["model"], r["global_batch"]]
                + [s.get(v) for v in variants]
                + [s["b"] / s["a"], s["c"] / s["d"], s["c"] / (2 * s["b1"]), s["c"] / s["a"]]
            )
        parts.append(
            table(["model", "global batch"] + variants + ["b/a", "c/d", "c/(2 b1)", "c/a"], rows)
        )
    st = results.get("steps")
    if st:
        parts.append(
            f"\n### Steps per compiled call (`--steps-per-execution`, 0: auto), global "
            f"batch {st['global_batch']}: samples/s (best of {st['repeats']}, epochs 2-"
            f"{st['epochs']})\n"
        )
        values = st["values"]
        rows = []
        for r in st["rows"]:
            s = {int(k): v for k, v in r["samples_per_sec"].items()}
            rows.append(
                [r["model"], {"b": 1, "c": 2}[r["variant"]]]
                + [s[k] for k in values]
                + [s[0] / s[1] if 0 in s and 1 in s else None]
            )
        parts.append(
            table(
                ["model", "processes"] + [str(k) if k else "auto" for k in values] + ["auto/1"],
                rows,
            )
        )
    tta = results.get("tta")
    if tta:
        parts.append(tta_section(tta))
    tl = results.get("timeline")
    if tl:
        parts.append(
            f"\n### Horovod timeline ({tl['model']}, batch {tl['global_batch']}, 2 "
            "processes): seconds per activity, summed over tensors and ranks\n"
        )
        if tl.get("steps"):
            parts.append(
                f"{tl['steps']} training steps in {tl['epochs']} epochs; "
                f"{tl['allreduce_rounds']} allreduce negotiation rounds in all (a grouped "
                f"allreduce counts once), {tl.get('training_rounds', '?')} from the "
                "first step's to the last step's.\n"
            )
        parts.append(
            table(
                ["activity", "seconds", "count"],
                [(k, v, tl["counts"].get(k)) for k, v in tl["seconds"].items()],
            )
        )
    fit = results.get("fit")
    if fit:
        parts.append(
            f"\n### model.fit, {fit['ranks']} processes, batch {fit['batch_per_rank']} "
            f"per rank, 784-{fit['hidden_units']}-10 MLP, Fashion-MNIST: samples/s (best of "
            f"{fit['repeats']}, epochs 2-{fit['epochs']})\n"
        )
        if fit.get("counts"):
            parts.append(fit["counts"] + "\n")
        parts.append(
            table(
                ["variant", "samples/s"],
                [(label, fit["samples_per_sec"][v]) for v, label in fit["variants"].items()],
            )
        )
        parts.append("\n" + table(["ratio", "value"], list(fit["ratios"].items())))
    sp = results.get("sparse")
    if sp:
        parts.append(
            f"\n### An Embedding's sparse gradient, {sp['ranks']} processes: "
            f"Embedding({sp['rows']:,}, {sp['columns']}), batch {sp['batch_per_rank']} "
            f"per rank, Adam, {sp['steps']} steps, Task path\n"
        )
        parts.append(
            table(
                ["variant", "MB reduced or gathered a step", "largest tensor", "samples/s"],
                [
                    (v, r["bytes_per_step"] / 1e6, str(r["largest"]), r["samples_per_sec"])
                    for v, r in sp["variants"].items()
                ],
            )
        )
        parts.append("\n" + table(["ratio", "value"], list(sp["ratios"].items())))
    ks = results.get("keras_speed")
    if ks:
        parts.append(
            f"\n### Keras paths against Keras' and Horovod's own, softmax, global batch "
            f"{ks['global_batch']}: samples/s (the fastest of epochs 2-{ks['epochs']}, best "
            f"of {ks['repeats']} launches, every launch round-robin)\n"
        )
        if ks.get("counts"):
            parts.append(ks["counts"] + "\n")
        s = ks["samples_per_sec"]
        r = ks["ratios"]
        rows = [
            (
                f"2 processes, steps_per_execution {spe}",
                s[f"hk_k2_spe{spe}"],
                s[f"hk_k3_spe{spe}"],
                s[f"hvd_k2_spe{spe}"],
                s[f"hvd_arrays_k2_spe{spe}"],
                r[f"fit_k2_spe{spe}"],
                r[f"fit_k3_spe{spe}"],
            )
            for spe in ks["spes"]
        ]
        parts.append(
            table(
                [
                    "fit",
                    "hk.fit, tf_keras",
                    "hk.fit, Keras 3",
                    "Horovod, tf.data shuffle",
                    "Horovod, arrays",
                    "hk tf_keras / Horovod's best",
                    "hk Keras 3 / Horovod's best",
                ],
                rows,
            )
        )
        pairs = [
            (
                f"{KERAS[tag]}, steps_per_execution {spe}",
                len(ks["paired"][name]),
                min(ks["paired"][name]),
                r[name],
                max(ks["paired"][name]),
            )
            for spe in ks["spes"]
            for tag in ks["kerases"]
            for name in [f"pair_{tag}_spe{spe}"]
            if ks.get("paired", {}).get(name)
        ]
        if pairs:
            parts.append(
                f"\nThe same two fits in the same 2 processes, epoch after epoch "
                f"({ks['pair_epochs']} epochs a launch): Horovod's epoch seconds / "
                "hk.fit's, for each pair after the first (> 1: hk.fit the faster)\n"
            )
            parts.append(table(["paired fits", "pairs", "least", "median", "most"], pairs))
        parts.append(
            "\n"
            + table(
                ["1 process, steps_per_execution 64", "Task path", "model.fit", "Task / fit"],
                [
                    (
                        KERAS[tag],
                        s[f"task_{tag}"],
                        s[f"keras_{tag}"],
                        s[f"task_{tag}"] / s[f"keras_{tag}"],
                    )
                    for tag in ks["kerases"]
                ],
            )
        )
        parts.append(
            "\n"
            + table(
                [f"hk.fit, mlp-{ks['bn_units']} + BN, 2 processes, Keras 3", "samples/s"],
                [
                    ("moving statistics synced (hvdtrain)", s["bn_sync"]),
                    ("not synced (the bench's knob)", s["bn_nosync"]),
                    (
                        "extra step time of the sync (synced / not - 1)",
                        ks["ratios"]["bn_sync_cost"],
                    ),
                    (
                        "the sync's own seconds / the training's seconds",
                        ks["ratios"]["bn_sync_share"],
                    ),
                ],
            )
        )
    pl = results.get("pipeline")
    if pl:
        parts.append(
            f"\n### Your own data: a tf.data pipeline from {pl['files']} TFRecord files, "
            f"{pl['ranks']} processes, batch {pl['batch_per_rank']} per rank, "
            f"784-{pl['hidden_units']}-10 MLP, Fashion-MNIST, tf_keras: samples/s (best "
            f"of {pl['repeats']}, epochs 2-{pl['epochs']})\n"
        )
        if pl.get("counts"):
            parts.append(pl["counts"] + "\n")
        parts.append(
            table(
                ["variant", "samples/s"],
                [(label, pl["samples_per_sec"][v]) for v, label in pl["variants"].items()],
            )
        )
        parts.append("\n" + table(["ratio", "value"], list(pl["ratios"].items())))
    if results.get("models"):
        from hvdtrain.bench import model_cases

        parts.append(model_cases.section(results["models"], table))
    if results.get("models_np1"):
        from hvdtrain.bench import model_cases

        parts.append(model_cases.alone_section(results["models_np1"], table))
    return "\n".join(parts)


def tta_section(tta) -> str:
    """Time to accuracy (training seconds, evaluation excluded) and, beside the training, the
    process wall time of the whole job, with what each variant's process does."""
    rows = tta["rows"]
    text = (
        f"\n### Time to {tta['target']} test accuracy ({tta['model']}, global batch "
        f"{tta['global_batch']}, lr {tta['lr']}; training seconds, evaluation excluded) "
        f"and the process wall time of {tta.get('max_epochs', '?')} epochs\n\n"
        "Process wall: the launch to the process's end, every variant training every "
        "epoch and scoring the test set; training s: the seconds of all its epochs.\n\n"
    )
    text += table(
        [
            "variant",
            "seconds to target",
            "epochs",
            "training s",
            "process wall s",
            "wall / training",
        ],
        [
            (
                r["label"],
                r["seconds"],
                r["epochs"],
                r.get("train_seconds"),
                r["wall"],
                r["wall"] / r["train_seconds"] if r.get("train_seconds") else None,
            )
            for r in rows.values()
        ],
    )
    if tta.get("wall_ratios"):
        text += "\n" + table(
            ["process wall ratio", "value", "target"],
            [
                ("hvdtrain 2 processes / MWMS 2 workers", tta["wall_ratios"]["c/d"], "<= 0.8"),
                ("hvdtrain 1 process / plain Keras 1 process", tta["wall_ratios"]["b/k"], "<= 1"),
            ],
        )
    text += "\n" + "".join(f"- {r['label']}: {r['does']}\n" for r in rows.values() if "does" in r)
    return text


def plots(results, out: str) -> list:
    """PNG plots into ``out``; returns their paths (none when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    ar = results.get("allreduce")
    if ar:
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=90)
        for name, rows in ar["series"].items():
            ax.loglog(
                [r["bytes"] for r in rows], [r["busbw"] / 1e9 for r in rows], "o-", label=name, ms=3
            )
        ax.set_xlabel("bytes (float32)")
        ax.set_ylabel("bus bandwidth, GB/s")
        ax.set_title(f"Allreduce, {ar['ranks']} processes")
        # Beside the axes, not on them: the lines run into every corner.
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
        ax.grid(True, which="both", alpha=0.3)
        made.append(_save(fig, os.path.join(out, "bench_allreduce.png")))
    tp = results.get("throughput")
    if tp:
        models = list(dict.fromkeys(r["model"] for r in tp["rows"]))
        fig, axes = plt.subplots(
            1, len(models), figsize=(5 * len(models), 3.6), dpi=90, squeeze=False
        )
        for ax, model in zip(axes[0], models):
            rows = [r for r in tp["rows"] if r["model"] == model]
            variants = [v for v in tp["variants"] if v in rows[0]["samples_per_sec"]]
            width = 0.8 / len(variants)
            for i, v in enumerate(variants):
                ax.bar(
                    [j + i * width for j in range(len(rows))],
                    [r["samples_per_sec"][v] for r in rows],
                    width,
                    label=f"{v}: {tp['variants'][v]}",
                )
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
            ax.set_xticklabels([str(r["global_batch"]) for r in rows])
            ax.set_xlabel("global batch")
            ax.set_ylabel("samples/s")
            ax.set_title(model)
        # Beside the last panel, not over the first one's bars; every panel's variants (one
        # model may have a variant another lacks).
        handles = {}
        for ax in axes[0]:
            for handle, label in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(label, handle)
        axes[0][-1].legend(
            list(handles.values()),
            list(handles),
            fontsize=7,
            loc="upper left",
            bbox_to_anchor=(1.02, 1),
        )
        made.append(_save(fig, os.path.join(out, "bench_throughput.png")))
    for key, name in (("models", "bench_models.png"), ("models_np1", "bench_models_np1.png")):
        if results.get(key) and results[key]["rows"]:
            made.append(_models_plot(plt, results[key], os.path.join(out, name)))
    return made


def _models_plot(plt, m, path):
    """A panel per model (per Keras and model, one process): each variant's median samples/s,
    its least-most range as an error bar."""
    rows, variants = m["rows"], list(m["variants"])
    fig, axes = plt.subplots(
        1, len(rows), figsize=(3.2 * len(rows) + 1, 3.6), dpi=90, squeeze=False
    )
    for ax, r in zip(axes[0], rows):
        med = [r["samples_per_sec"][v] for v in variants]
        low = [m_ - r["spread"][v][0] for v, m_ in zip(variants, med)]
        high = [r["spread"][v][1] - m_ for v, m_ in zip(variants, med)]
        ax.bar(
            range(len(variants)),
            med,
            yerr=[low, high],
            capsize=3,
            color=[f"C{i}" for i in range(len(variants))],
        )
        ax.set_xticks(range(len(variants)))
        ax.set_xticklabels(variants, rotation=45, ha="right", fontsize=7)
        ax.set_title(
            r["model"] + (f", {m['kerases'][r['keras']]}" if "keras" in r else ""), fontsize=9
        )
        ax.set_ylabel("samples/s")
    return _save(fig, path)


def _save(fig, path):
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")  # a legend beside the axes included
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
