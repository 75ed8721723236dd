"""Link profiles: the compute-to-network ratio an emulated host stands for, with its arithmetic.

An emulated process is "one core with a link of R, scaled by --cpu-share". Which R is honest
depends on what a worker computes with. The harness's processes compute on CPU cores; a real
embedding-heavy job's workers compute on GPUs, which run these models' dense layers far
faster than a core, while their NICs are not faster by as much. Keeping the emulated core,
the link that gives a GPU worker's ratio is R = (NIC bandwidth per GPU) / (GPU speed / core
speed).

`core` (1 Gbit/s per core, the default `--networks 1gbit`): a one-core host with a 1 GbE
NIC, i.e. CPU workers on commodity Ethernet. A current 8-GPU node is near this ratio too:
one 400 Gbit/s NIC per GPU (DGX H100-class nodes) and a GPU some 300-1000x a core's dense
throughput gives 0.4-1.3 Gbit/s per core-equivalent.

`paper` (167 Mbit/s per core): the Parallax paper's cluster (Kim et al., EuroSys 2019; the
project's README describes it as eight machines, each with six NVIDIA TITAN Xp GPUs and one
Mellanox ConnectX-4 100 Gbit/s InfiniBand card):

    NIC per GPU worker  = 100 Gbit/s / 6 GPUs           = 16.7 Gbit/s
    GPU / core (dense)  = ~100x (TITAN Xp: 12.1 TFLOP/s fp32 peak; one AVX2 core at
                          2.1-3 GHz: 67-96 GFLOP/s peak, so 126-181x at peak; small dense
                          layers reach less of a GPU's peak than of a core's, hence ~100x)
    link per core       = 16.7 Gbit/s / 100             = 167 Mbit/s
                          (93 Mbit/s if the GPU is 181x a core)

so that cluster is about 6x more network-bound than `core`. The profiles name links at one
core; `--cpu-share` scales them like any `--networks` value (`paper` at 0.25 core: 41.7
Mbit/s). Only the ratio is emulated: latency, RDMA and NVLink inside a node are not.
"""
from __future__ import annotations

from dataclasses import dataclass

from parallax.errors import ConfigError

NIC_GBIT_PER_PAPER_MACHINE = 100.0  # ConnectX-4 InfiniBand, one per machine
GPUS_PER_PAPER_MACHINE = 6           # TITAN Xp
GPU_OVER_CORE = 100.0                # dense throughput of one GPU / one core (see above)
PAPER_MBIT_PER_CORE = round(NIC_GBIT_PER_PAPER_MACHINE * 1000 / GPUS_PER_PAPER_MACHINE
                            / GPU_OVER_CORE)  # 167


@dataclass(frozen=True)
class LinkProfile:
    """A named compute-to-network ratio: the link one emulated core gets (a --networks
    value) and where the ratio comes from."""

    name: str
    network: str
    source: str


PROFILES = {
    "core": LinkProfile("core", "1gbit", "one core with a 1 Gbit/s NIC (CPU workers on "
                        "commodity Ethernet)"),
    "paper": LinkProfile("paper", f"{PAPER_MBIT_PER_CORE}mbit",
                         f"the Parallax paper's GPU worker: {NIC_GBIT_PER_PAPER_MACHINE:g} "
                         f"Gbit/s per {GPUS_PER_PAPER_MACHINE} GPUs, a GPU ~"
                         f"{GPU_OVER_CORE:g}x a core: {PAPER_MBIT_PER_CORE} Mbit/s per core"),
}


def get(name: str) -> LinkProfile:
    try:
        return PROFILES[name.strip().lower()]
    except KeyError:
        raise ConfigError(f"link profile {name!r} is not known: choose from "
                          f"{', '.join(PROFILES)} (or give --networks a link such as "
                          f"1gbit)") from None


def note(profile: LinkProfile) -> str:
    """The results' note saying which network a profile ran as, and why."""
    return f"link profile {profile.name}: --networks {profile.network}, {profile.source}"
