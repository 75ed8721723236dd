"""The README's client example, runnable: `python examples/ps_quickstart.py`.

Starts two parameter servers on loopback, creates a sharded table with a server-side Adam
optimizer, pulls rows in the caller's order, pushes gradients for a step, and pulls again
once the step is applied.
"""
import numpy as np

from parallax import Adam, Initializer, PSClient, TableSpec
from parallax.client.local_cluster import LocalCluster


def main() -> None:
    with LocalCluster(2) as cluster, PSClient(cluster.addresses) as client:
        table = client.create_table(TableSpec(
            name="words", vocabulary_size=1_000_000, dim=64, shard_count=4,
            initializer=Initializer("uniform", minval=-0.05, maxval=0.05, seed=1),
            optimizer=Adam(learning_rate=1e-3), num_workers=1))
        rows = table.pull(np.array([[3, 17], [3, 99]]))              # (2, 2, 64)
        table.push(np.array([3, 3, 17]), np.ones((3, 64)), step=0)   # duplicates summed
        after = table.pull([3], min_step=1)                           # step 0 applied
        moved = float(np.abs(after[0] - rows[0, 0]).max())
        print(f"pulled {rows.shape}; row 3 moved by {moved:.4f}")
        print(f"servers {cluster.addresses}")


if __name__ == "__main__":
    main()
