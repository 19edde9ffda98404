"""Row padding on CPU: the model and its heads run a bounded set of row counts. Shared (no torch): the
input builder pads a step's rows, heads pad theirs (models/layers.on_padded_rows).

oneDNN, which runs our CPU linears (int8 too) and torch's bfloat16 matmuls, builds a primitive for every
shape it is given and keeps it in two caches of 1,024 entries each (oneDNN's own and ideep's; about 0.3 MiB
an entry on MiniLM's shapes). Steps of every possible size churned both caches without end, and their
long-lived entries interleaved with each step's activations in the heap, which then grew without bound: 80
to 125 MiB a minute under steady load (docs/PERFORMANCE.md, "Memory under steady load"). Padded to a
bounded set of sizes, every primitive is built once and stays cached, and the heap stops growing.

The input builder pads the step's token rows (and the encoder's, the prefill skip's kept rows and the
sampled rows); padding rows belong to no sequence: attention leaves them out and yields zeros there, and
the runner drops them before the heads. Heads whose rows are sequences or tokens (Dense poolers, token,
sparse and colbert heads) pad and cut back their own. A worker's warm-up runs the model's linears at every
count (row_counts; models/layers.warm_linear_row_counts), so no primitive is built mid-step.
"""

from __future__ import annotations

import numpy as np

# Row counts up to 256 are padded to a multiple of this; above, to 16 sizes per power of two.
_MIN_STEP = 16


def padded_rows(num_rows: int) -> int:
    """`num_rows` rounded up to the next multiple of 16 up to 256, and above that to the next multiple of
    1/16 of the power of two below it: at most 6.25% more rows from 256 on, 80 sizes from 1 to 4,096."""
    step = max(_MIN_STEP, 1 << max(0, num_rows.bit_length() - 5))
    return -(-num_rows // step) * step


def row_counts(max_rows: int) -> list[int]:
    """Every count padded_rows() gives for 1..max_rows rows (the last may exceed max_rows)."""
    counts = [padded_rows(1)]
    while counts[-1] < max_rows:
        counts.append(padded_rows(counts[-1] + 1))
    return counts


def pad(values: np.ndarray, rows: int) -> np.ndarray:
    """`values` followed by zeros up to `rows` entries."""
    if len(values) >= rows:
        return values
    return np.concatenate((values, np.zeros(rows - len(values), dtype=values.dtype)))
