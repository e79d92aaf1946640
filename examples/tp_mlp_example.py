"""A gated MLP split over GPUs: gate_up column-parallel, down row-parallel.

    python examples/tp_mlp_example.py --shards 4          # one device (NumPy or one GPU)
    python examples/tp_mlp_example.py --gpus 2            # one process per GPU, NCCL

Each rank holds ``[2 I/n, H]`` of gate_up (its gate rows, then its up rows)
and ``[H, I/n]`` of down. ``x`` goes to every rank whole; gate_up's output
stays on the rank (no all-gather), SwiGLU runs there, and down's partial
products are summed by one all-reduce: the only communication of the MLP.
The result is compared with the unsharded MLP. With ``--save DIR`` the
shards are also written one safetensors file per rank and read back.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kbit_cupy as kc
from kbit_cupy import parallel

HIDDEN, INTERMEDIATE = 1024, 2816  # 2816 = 88 blocks of 32: splits 2, 4, 8 ways


def make_mlp(xp, seed=0):
    """gate, up [I, H] and down [H, I], quantized at k = 4 in ``xp`` (NumPy or CuPy)."""
    rng = np.random.default_rng(seed)
    shapes = [(INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    return [kc.quantize_weight(xp.asarray(rng.standard_normal(s).astype(np.float16) * 0.05), k=4)
            for s in shapes]


def make_input(xp, M=4, seed=1):
    return xp.asarray(np.random.default_rng(seed).standard_normal((M, HIDDEN)).astype(np.float16))


def relative_difference(y, ref) -> float:
    y = np.asarray(getattr(y, "get", lambda: y)(), np.float64)
    ref = np.asarray(getattr(ref, "get", lambda: ref)(), np.float64)
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def rank_main(group, save_dir):
    """One GPU's part (run by ``parallel.run_on_gpus`` in its own process)."""
    import cupy as cp

    gate, up, down = make_mlp(cp)  # every rank quantizes the same weights
    gate_up, down_shard = kc.shard_mlp(gate, up, down, group.size)[group.rank]
    if save_dir:  # each rank writes its own file and reads it back
        path = parallel.shard_path(os.path.join(save_dir, "mlp"), group.rank, group.size)
        place = kc.ShardPlace(group.rank, group.size, {"gate_up": "column", "down": "row"})
        kc.save_shard(path, {"gate_up": gate_up, "down": down_shard}, place)
        loaded = kc.load_shard(path, rank=group.rank, n_shards=group.size, device="gpu")
        gate_up, down_shard = loaded["gate_up"], loaded["down"]
    mlp = kc.TensorParallelMLP(gate_up, down_shard, group)
    x = make_input(cp)
    y = mlp(x)
    ref = parallel.mlp_reference(x, kc.join_shards([gate, up], "column"), down)
    return relative_difference(y, ref)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=2, help="one device: simulate this many ranks")
    p.add_argument("--gpus", type=int, default=0, help="run on this many GPUs over NCCL")
    p.add_argument("--save", metavar="DIR", help="write and read back one file per shard")
    a = p.parse_args()
    if a.gpus:
        diffs = parallel.run_on_gpus(rank_main, a.gpus, a.save)
        for rank, d in enumerate(diffs):
            print(f"rank {rank}: relative difference to the unsharded MLP {d:.2e}")
        return 0
    from kbit_cupy._arrays import gpu_available

    if gpu_available():
        import cupy as xp
    else:
        xp = np
    gate, up, down = make_mlp(xp)
    shards = kc.shard_mlp(gate, up, down, a.shards)
    if a.save:
        plan = {"gate_up": "column", "down": "row"}
        paths = kc.save_sharded(os.path.join(a.save, "mlp"),
                                [{"gate_up": gu, "down": d} for gu, d in shards], plan)
        loaded = [kc.load_shard(path, rank=r, n_shards=a.shards) for r, path in enumerate(paths)]
        shards = [(m["gate_up"], m["down"]) for m in loaded]
        if xp is not np:
            shards = [(gu.to_device(), d.to_device()) for gu, d in shards]
        print(f"wrote {len(paths)} shard files under {a.save}")
    x = make_input(xp)
    y = parallel.simulate_mlp(x, shards)
    ref = parallel.mlp_reference(x, kc.join_shards([gate, up], "column"), down)
    where = "one GPU" if xp is not np else "NumPy"
    print(f"{a.shards} simulated ranks on {where}: relative difference to the unsharded MLP "
          f"{relative_difference(y, ref):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
