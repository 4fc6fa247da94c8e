"""Print the README's markdown table of supported model types, from `get_supported_model_types()`.

    python scripts/supported_models.py            # every type (hand-written parallelizers first)
    python scripts/supported_models.py --hand-written

TP is every listed type; SP and PP say what the parallelizer declares (`supports_sequence_parallel`,
`supports_pipeline_parallel`). "tested" marks the types the test suite runs against transformers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import optimum_parallel as op

TESTS = Path(__file__).resolve().parent.parent / "tests"


def tested_model_types() -> set[str]:
    """Model types the test modules run against the single-device transformers model (their CASES)."""
    sys.path.insert(0, str(TESTS))
    tested: set[str] = set()
    for module in ("test_llama_tp", "test_families", "test_auto_plan"):
        try:
            cases = __import__(module).CASES
        except Exception:  # noqa: BLE001 - a missing or broken test module just marks nothing
            continue
        tested.update(case[0] for case in cases)
    return tested


def table(hand_written_only: bool = False) -> str:
    manager = op.ParallelizersManager
    hand_written = set(manager.get_supported_model_types(include_auto=False))
    types = sorted(hand_written) if hand_written_only else manager.get_supported_model_types()
    types.sort(key=lambda t: (t not in hand_written, t))
    tested = tested_model_types()
    yes = lambda flag: "yes" if flag else "no"  # noqa: E731
    lines = [
        "| model type | parallelizer | TP | SP | PP | tested |",
        "|---|---|---|---|---|---|",
    ]
    for model_type in types:
        cls = manager.parallelizer_for_model(model_type)
        name = f"`{cls.__name__}`" if model_type in hand_written else "automatic (`base_model_tp_plan`)"
        sp, pp = getattr(cls, "supports_sequence_parallel", False), getattr(cls, "supports_pipeline_parallel", False)
        lines.append(f"| `{model_type}` | {name} | yes | {yes(sp)} | {yes(pp)} | {yes(model_type in tested)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hand-written", action="store_true", help="only model types with a hand-written parallelizer")
    print(table(parser.parse_args().hand_written))


if __name__ == "__main__":
    main()
