"""Write a verl RL dataset (parquet) whose rows the rollstream agent loop runs: each row's
extra_info.rollstream names the task and instance. Usage:
    python examples/verl/make_dataset.py --out ~/data/arith --n-train 2048 --n-test 128"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from rollstream.integrations.verl_mapping import dataset_row
from rollstream.tasks import arith


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--n-train", type=int, default=2048)
    parser.add_argument("--n-test", type=int, default=128)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", args.n_train, 0), ("test", args.n_test, 1)):
        rows = [dataset_row("arith", inst, index=i) for i, inst in enumerate(arith.make_instances(n, seed=seed))]
        pd.DataFrame(rows).to_parquet(args.out / f"{split}.parquet")
        print(f"{split}: {n} rows -> {args.out / f'{split}.parquet'}")


if __name__ == "__main__":
    main()
