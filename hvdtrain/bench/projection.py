"""``python -m hvdtrain.bench project``: projected samples/s and scaling efficiency of
synchronous data-parallel training on GPU clusters (8-512 GPUs) that this machine is not.

    python -m hvdtrain.bench project                        # every model, every fabric
    python -m hvdtrain.bench project --model resnet50 --overlap 0
    python -m hvdtrain.bench project --compute-ms 120 --gradient-mb 100 --batch 256

The cost of one step on N GPUs (N = 1 costs nothing but the compute):

    t_step(N)   = t_compute + (1 - overlap) * t_reduce(N)
    t_reduce(N) = 2 (N-1)/N * bytes / busbw(N)  +  calls * latency(N)
    busbw(N)    = the NVLink bus bandwidth within a node (N <= 8); beyond, NCCL's ring through
                  NVLink inside each node and the network between them, so the slower of the
                  two: min(NVLink, the node's network bandwidth)
    calls       = ceil(bytes / fusion): Horovod fuses the gradients into buffers of at most
                  HOROVOD_FUSION_THRESHOLD (128 MiB), one collective each
    latency(N)  = Horovod's fixed cost per collective (calibrated here) + a hop latency times
                  2 log2 N (NCCL's trees at scale)
    samples/s   = N * batch / t_step(N);  efficiency = t_compute / t_step(N)

``overlap`` is the share of the reduction hidden behind the backward pass: 0.5 by default, for
hvdtrain's gradient buckets and Horovod's own tape and Keras wrapper alike (each part reduced
as soon as the backward pass has produced it), the share the published-point check uses; 0 is
a reduction that starts only when every gradient is ready (``HVDTRAIN_BUCKET_BYTES=0``).
``--results`` projects each model measured here at the overlap its Task path's timeline
showed. Every constant is printed with the tables, marked calibrated (on
this machine, from docs/performance/index.md's allreduce table), published (its source named)
or assumed.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

MB = 1e6
GB = 1e9
FUSION = 128 << 20  # Horovod's default HOROVOD_FUSION_THRESHOLD, bytes
GPUS = (8, 16, 32, 64, 128, 256, 512)
PER_NODE = 8  # GPUs per node (DGX/HGX A100 and H100)

# This machine's host path (2 processes, hvd.allreduce inside a tf.function, as a step calls
# it: docs/performance/index.md's allreduce table, column hvd_mpi_graph): bytes -> seconds.
HOST_ALLREDUCE = {
    4 << 10: 173e-6,
    16 << 10: 184e-6,
    64 << 10: 150e-6,
    256 << 10: 156e-6,
    1 << 20: 218e-6,
    4 << 20: 755e-6,
    16 << 20: 2713e-6,
    64 << 20: 18033e-6,
}


def calibrate(table=HOST_ALLREDUCE) -> tuple:
    """(latency s, busbw bytes/s) of a 2-process allreduce from measured (bytes, seconds):
    the latency is the median time of the sizes up to 256 KiB (where the bytes cost nothing
    measurable); the bandwidth that of the largest size, the gradients' regime (64 MiB here:
    slower than 4-16 MiB, page faults and all, as a 94-151 MB gradient meets them)."""
    small = sorted(t for b, t in table.items() if b <= 256 << 10)
    latency = (
        small[len(small) // 2]
        if len(small) % 2
        else sum(small[len(small) // 2 - 1 : len(small) // 2 + 1]) / 2
    )
    big = max(table)
    return latency, big / (table[big] - latency)  # N = 2: 2(N-1)/N = 1


HOST_LATENCY, HOST_BUSBW = calibrate()


@dataclasses.dataclass(frozen=True)
class Fabric:
    """Where the gradients travel: NVLink inside a node of ``per_node`` GPUs and, beyond one
    node, a network of ``nics`` ports of ``line_gbps`` Gb/s per node at ``efficiency`` of
    line rate (bytes/s: ``network``)."""

    name: str
    nvlink: float  # bus bandwidth within a node, bytes/s
    line_gbps: float = 0.0
    nics: int = 1
    efficiency: float = 0.9  # assumed: ~90 % of line rate (RoCE/IB with large messages)
    hop: float = 5e-6  # assumed: per network hop, s
    per_node: int = PER_NODE

    @property
    def network(self) -> float:
        return self.nics * self.line_gbps / 8 * GB * self.efficiency

    def reaches(self, n: int) -> bool:
        """Whether ``n`` GPUs fit: one node without a network, any number with one."""
        return n <= self.per_node or self.line_gbps > 0

    def busbw(self, n: int) -> float:
        if n <= self.per_node:
            return self.nvlink
        if not self.line_gbps:
            raise ValueError(f"{self.name}: {n} GPUs need more than one node")
        return min(self.nvlink, self.network)


# NVLink: nccl-tests all_reduce_perf busbw of 8 A100 SXM4 (NVSwitch): 200-208 GB/s reported
# (github.com/NVIDIA/nccl-tests/issues/149 and /178): published. The networks: line rates,
# published; their 0.9 efficiency and hop latencies: assumed.
NVLINK_A100 = 200 * GB
FABRICS = {
    "nvlink": Fabric("NVLink, one node of 8", NVLINK_A100, hop=1e-6),
    "25gbe": Fabric("NVLink + 25 GbE x1", NVLINK_A100, 25, 1, hop=10e-6),
    "ib100": Fabric("NVLink + 100 Gb/s IB x1", NVLINK_A100, 100, 1),
    "ib400": Fabric("NVLink + 400 Gb/s IB x1", NVLINK_A100, 400, 1),
    "ib400x8": Fabric("NVLink + 400 Gb/s IB x8", NVLINK_A100, 400, 8),
}


@dataclasses.dataclass(frozen=True)
class Model:
    """One GPU's step: ``batch`` samples in ``compute`` seconds, ``gradient_bytes`` reduced."""

    name: str
    batch: int
    compute: float
    gradient_bytes: float
    source: str


MODELS = {
    "resnet50": Model(
        "ResNet-50 v1.5, A100, mixed precision",
        256,
        256 / 2375,
        25.5e6 * 4,
        "2,375 img/s on 1 A100 40GB, batch 256, mixed precision + XLA: NVIDIA "
        "DeepLearningExamples, TensorFlow/Classification/ConvNets/resnet50v1.5/README.md "
        "(DGX A100 training performance); 25.5 M float32 gradients",
    ),
    "bert-large": Model(
        "BERT-large pre-training, seq 128, A100",
        312,
        312 / 485.59,
        335e6 * 4,
        "485.59 sequences/s on 1 A100 80GB, batch 312, mixed precision: NVIDIA "
        "DeepLearningExamples, TensorFlow2/LanguageModeling/BERT/README.md (single-node DGX "
        "A100 pre-training); 335 M float32 gradients, reduced every step (no accumulation)",
    ),
    "mlp-4096": Model(
        "wide MLP 1024-3x4096-10, A100",
        256,
        6 * 37.8e6 * 256 / (0.5 * 156e12),
        37.8e6 * 4,
        "derived, not measured: 6 x 37.8 M parameters x 256 FLOPs a step at half of A100's "
        "156 TFLOP/s TF32 peak (NVIDIA A100 datasheet; the half: assumed): the "
        "bandwidth-bound case",
    ),
}


def latency(n: int, fabric: Fabric, software: float = HOST_LATENCY) -> float:
    """One collective's fixed cost on ``n`` GPUs: Horovod's own (``software``) and the hops."""
    if n <= 1:
        return 0.0
    return software + fabric.hop * 2 * math.ceil(math.log2(n))


def reduce_seconds(
    n: int, nbytes: float, fabric: Fabric, fusion: int = FUSION, software: float = HOST_LATENCY
) -> float:
    """Seconds to allreduce ``nbytes`` of gradients over ``n`` GPUs (0 for one GPU)."""
    if n <= 1:
        return 0.0
    calls = max(1, math.ceil(nbytes / fusion))
    return 2 * (n - 1) / n * nbytes / fabric.busbw(n) + calls * latency(n, fabric, software)


def project(model: Model, n: int, fabric: Fabric, overlap: float = 0.5, **kw) -> dict:
    """samples/s and efficiency of ``model`` on ``n`` GPUs of ``fabric``."""
    step = model.compute + (1 - overlap) * reduce_seconds(n, model.gradient_bytes, fabric, **kw)
    return {
        "samples_per_sec": n * model.batch / step,
        "efficiency": model.compute / step,
        "step": step,
    }


# --- the published points the model is checked against ---------------------------------------

# The Horovod paper's cluster: servers of 4 P100 on PCIe (assumed 10 GB/s bus bandwidth inside,
# PCIe 3.0 x16) and one 25 Gb/s RoCE port each.
P100_25GBE = Fabric("4 P100 on PCIe + 25 GbE RoCE x1", 10 * GB, 25, 1, hop=10e-6, per_node=4)
CHECKS = [  # (what, model, GPUs, fabric, overlap, published efficiency, tolerance, source)
    (
        "Inception V3, 512 P100, 25 GbE RoCE",
        Model(
            "Inception V3, P100",
            64,
            64 / 142,
            23.8e6 * 4,
            "142 img/s on 1 P100, batch 64, synthetic data: tensorflow.org/performance/"
            "benchmarks (DGX-1)",
        ),
        512,
        P100_25GBE,
        0.5,
        0.90,
        0.05,
        "Sergeev & Del Balso 2018, Horovod (arXiv:1802.05799): ~90 %",
    ),
    (
        "ResNet-101, 512 P100, 25 GbE RoCE",
        Model(
            "ResNet-101, P100",
            64,
            64 / (219 * 4.1 / 7.8),
            44.5e6 * 4,
            "219 img/s of ResNet-50 on 1 P100 (tensorflow.org/performance/benchmarks) scaled "
            "by FLOPs, 4.1/7.8 GFLOPs: derived",
        ),
        512,
        P100_25GBE,
        0.5,
        0.90,
        0.05,
        "Sergeev & Del Balso 2018: ~90 %",
    ),
]
# Bus bandwidths: (what, GPUs, fabric, published busbw bytes/s, tolerance, source)
BUS_CHECKS = [
    (
        "8 A100, NVLink, 1 GiB",
        8,
        FABRICS["nvlink"],
        204 * GB,
        0.1,
        "github.com/NVIDIA/nccl-tests/issues/149 and /178: 200-208 GB/s",
    ),
    (
        "24 A100, 3 nodes, 4 x 200 Gb/s HDR each, 128 MiB",
        24,
        Fabric("NVLink + 200 Gb/s IB x4", NVLINK_A100, 200, 4),
        90 * GB,
        0.1,
        "github.com/NVIDIA/nccl-tests/issues/119: 84.8 GB/s average, 96 peak (90: between them)",
    ),
]
# Published whole-training scaling, beyond what the model counts (its reduction only: not the
# input pipeline, stragglers, the host): printed beside the checks, no tolerance claimed.
# (what, model, GPUs, fabric, overlap, published efficiency against one GPU, source)
SCOPE = [
    (
        "ResNet-50, 8 A100 (one DGX A100)",
        MODELS["resnet50"],
        8,
        FABRICS["nvlink"],
        0.5,
        17400 / (8 * 2375),
        "NVIDIA DeepLearningExamples resnet50v1.5 (TensorFlow): 17,400 img/s "
        "on 8 against 2,375 on 1",
    ),
    (
        "BERT-large seq 128, 256 A100 (32 DGX A100, 8 x 200 Gb/s HDR each)",
        MODELS["bert-large"],
        256,
        Fabric("NVLink + 200 Gb/s IB x8", NVLINK_A100, 200, 8),
        0.5,
        110280.73 / (256 * 485.59),
        "NVIDIA DeepLearningExamples BERT (TensorFlow2): 110,281 "
        "sequences/s on 256 (no gradient accumulation) against 485.59 on 1",
    ),
]


def check_rows(overlap=None) -> list:
    """[(what, projected, published, tolerance, within, source)] for every published point:
    efficiencies (at each check's stated overlap, or ``overlap``) and bus bandwidths
    (algbw * 2(N-1)/N of the projected allreduce, latency included)."""
    rows = []
    for what, model, n, fabric, ov, published, tol, source in CHECKS:
        got = project(model, n, fabric, ov if overlap is None else overlap)["efficiency"]
        rows.append(
            (f"efficiency: {what}", got, published, tol, abs(got - published) <= tol, source)
        )
    for what, n, fabric, published, tol, source in BUS_CHECKS:
        nbytes = (1 << 30) if "GiB" in what else (128 << 20)
        # nccl-tests calls NCCL directly: one call, none of Horovod's own cost
        got = (
            2
            * (n - 1)
            / n
            * nbytes
            / reduce_seconds(n, nbytes, fabric, fusion=nbytes, software=0.0)
        )
        rows.append(
            (
                f"busbw GB/s: {what}",
                got / GB,
                published / GB,
                tol * published / GB,
                abs(got - published) <= tol * published,
                source,
            )
        )
    return rows


def markdown(models, fabrics, overlap, gpus=GPUS) -> str:
    """The assumptions, one table per model (samples/s and efficiency per fabric), and the
    check against the published points."""
    from hvdtrain.bench.report import table

    out = [
        "### Projected scaling (a cost model, not a measurement)\n",
        f"Overlap of the reduction with the backward pass: {overlap:g}. Horovod fusion "
        f"buffer {FUSION >> 20} MiB. Constants:\n",
        f"- Horovod's fixed cost per collective: {HOST_LATENCY * 1e6:.0f} us, calibrated "
        "on this machine (2 processes, the median hvd.allreduce in a tf.function up to "
        "256 KiB)",
        f"- this machine's host bus bandwidth: {HOST_BUSBW / GB:.2f} GB/s, calibrated (64 "
        "MiB); used only for `--results`: the models measured here, projected to 2 processes",
        f"- NVLink (A100, NVSwitch, 8 per node): {NVLINK_A100 / GB:.0f} GB/s bus "
        "bandwidth, published (nccl-tests all_reduce_perf, github.com/NVIDIA/nccl-tests/"
        "issues/149 and /178)",
        "- networks: line rate per port, published; 90 % of it reached and the hop "
        "latencies (1 us NVLink, 5 us IB, 10 us Ethernet), assumed",
    ]
    out += [
        f"- {m.name}: {m.batch / m.compute:,.0f} samples/s per GPU at batch {m.batch}, "
        f"{m.gradient_bytes / MB:,.0f} MB of gradients: {m.source}"
        for m in models
    ]
    out.append("")
    for m in models:
        rows = []
        for n in gpus:
            cells = [n, n // PER_NODE if n > PER_NODE else 1]
            for f in fabrics:
                if not f.reaches(n):
                    cells.append("-")
                    continue
                p = project(m, n, f, overlap)
                cells.append(f"{p['samples_per_sec']:,.0f} ({p['efficiency']:.2f})")
            rows.append(cells)
        out.append(f"\n{m.name}: samples/s (scaling efficiency)\n")
        out.append(table(["GPUs", "nodes"] + [f.name for f in fabrics], rows))
    out.append("\nThe model against published points (each at its stated overlap: Horovod's 0.5)\n")
    out.append(
        table(
            ["point", "projected", "published", "tolerance", "within", "source"],
            [(w, p, q, t, "yes" if ok else "**no**", s) for w, p, q, t, ok, s in check_rows()],
        )
    )
    out.append(
        "\nWhole-training scaling published by NVIDIA, beyond the model's scope (it counts "
        "only the reduction; the rest of a published loss is the input pipeline, "
        "stragglers and the host): the projection is an upper bound\n"
    )
    out.append(
        table(
            ["point", "projected efficiency", "published", "source"],
            [
                (what, project(m, n, f, ov)["efficiency"], pub, src)
                for what, m, n, f, ov, pub, src in SCOPE
            ],
        )
    )
    return "\n".join(out)


HOST = Fabric("this machine: 2 processes, shared memory", HOST_BUSBW, hop=0.0, per_node=2)


def measured_overlap(split: dict):
    """The share of a step's reduction its timeline showed hidden behind the backward pass
    (``model_cases.step_split``: 1 - not hidden / communication), or None without one."""
    if not split or split.get("communication", 0) <= 0:
        return None
    return min(1.0, max(0.0, 1 - split["not_hidden"] / split["communication"]))


def host_rows(results: dict) -> list:
    """The models measured here (a ``results.json`` of ``--cases models``) projected to 2
    processes on this machine's calibrated host path, at the overlap the Task path's timeline
    showed (0 without one), beside what each path measured:
    [(model, overlap, projected efficiency, {variant: measured efficiency})]. The compute: the
    one-process run at the same per-rank batch."""
    rows = []
    for r in results.get("models", {}).get("rows", []):
        one = r["samples_per_sec"]["one"]
        model = Model(
            r["model"],
            r["batch_per_rank"],
            r["batch_per_rank"] / one,
            r["gradient_bytes"],
            "measured here",
        )
        overlap = measured_overlap(r.get("step_split", {}).get("task")) or 0.0
        rows.append(
            (r["model"], overlap, project(model, 2, HOST, overlap)["efficiency"], r["efficiency"])
        )
    return rows


def plan(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m hvdtrain.bench project",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Projected samples/s and scaling efficiency on 8-512 GPUs: a cost model of "
        "the gradient reduction (ring, fusion, latency), its constants printed with the tables.",
    )
    p.add_argument(
        "--model",
        choices=("all", *MODELS),
        default="all",
        help="the models with published per-GPU figures",
    )
    p.add_argument(
        "--overlap",
        type=float,
        default=0.5,
        help="share of the reduction hidden behind the backward pass (hvdtrain's "
        "buckets and Horovod's own wrappers: about 0.5; 0: one reduction after "
        "the whole backward pass)",
    )
    p.add_argument(
        "--fabric",
        choices=("all", *FABRICS),
        default="all",
        help="NVLink in one node, or nodes of 8 on 25 GbE or InfiniBand",
    )
    p.add_argument("--compute-ms", type=float, help="your model: one GPU's step, ms")
    p.add_argument("--gradient-mb", type=float, help="your model: gradient MB per step")
    p.add_argument("--batch", type=int, default=256, help="your model: batch per GPU")
    p.add_argument(
        "--results",
        help="a results.json of --cases models: its models projected "
        "to 2 processes on this machine's host path, beside the measured",
    )
    args = p.parse_args(argv)
    if not 0 <= args.overlap <= 1:
        p.error(f"--overlap {args.overlap}: must be between 0 and 1")
    if (args.compute_ms is None) != (args.gradient_mb is None):
        p.error("--compute-ms and --gradient-mb go together")
    if args.compute_ms is not None:
        args.models = [
            Model(
                "your model",
                args.batch,
                args.compute_ms / 1e3,
                args.gradient_mb * MB,
                "given on the command line",
            )
        ]
    else:
        args.models = list(MODELS.values()) if args.model == "all" else [MODELS[args.model]]
    args.fabrics = list(FABRICS.values()) if args.fabric == "all" else [FABRICS[args.fabric]]
    return args


def main(argv=None) -> int:
    args = plan(argv)
    print(markdown(args.models, args.fabrics, args.overlap))
    if args.results:
        import json

        from hvdtrain.bench.report import table

        with open(args.results) as f:
            rows = host_rows(json.load(f))
        variants = sorted({v for *_, measured in rows for v in measured})
        print(
            "\nThe model on this machine (2 processes, the host path calibrated above, at "
            "the overlap the Task path's timeline showed) against the models measured here: "
            "scaling efficiency\n"
        )
        print(
            table(
                ["model", "overlap", "projected"] + variants,
                [
                    [m, ov, eff] + [measured.get(v) for v in variants]
                    for m, ov, eff, measured in rows
                ],
            )
        )
    return 0
