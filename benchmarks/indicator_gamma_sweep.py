"""How the qsync indicator's ranking depends on gamma, from bench_indicator.py's dump.

Recombines the dumped per-op terms [Var_fwd, Var_bwd] at int8 as
gamma * (L - d) * Var_fwd + d * Var_bwd for several gamma, plus each term alone, and prints
the Spearman correlation with the measured loss increases (fine-tuned and immediate).
No model is run: the measurements are the dump's.

    .venv/bin/python benchmarks/bench_indicator.py --dump /tmp/ind_dump.json
    .venv/bin/python benchmarks/indicator_gamma_sweep.py /tmp/ind_dump.json
"""

from __future__ import annotations

import json
import sys

from scipy.stats import spearmanr


def main(path: str) -> None:
    dumps = json.loads(open(path).read())
    for name, d in dumps.items():
        terms = d["terms_int8"].get("qsync:0")
        if not terms:
            continue
        ops, depth, big_l = d["ops"], d["depth"], d["max_depth"]
        print(f"== {name} ({len(ops)} ops)")
        print(f"{'combination':>22} {'rho ft':>8} {'rho now':>8}")
        variants = {f"gamma={g:g}": [g * (big_l - depth[o]) * t[0] + depth[o] * t[1]
                                     for o, t in zip(ops, terms, strict=True)]
                    for g in (0.25, 1, 4, 16, 64)}
        variants["Var_fwd only"] = [t[0] for t in terms]
        variants["Var_bwd only"] = [t[1] for t in terms]
        variants["(L-d) Var_fwd only"] = [(big_l - depth[o]) * t[0]
                                          for o, t in zip(ops, terms, strict=True)]
        for label, omega in variants.items():
            ft = spearmanr(omega, d["finetuned"]).statistic
            now = spearmanr(omega, d["immediate"]).statistic
            print(f"{label:>22} {ft:>8.3f} {now:>8.3f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/ind_dump.json")
