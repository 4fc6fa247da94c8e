"""The optimizer's param groups across layouts: regrouped per pipeline stage by a reshard, matched by name at load.

A checkpoint records each pp rank's param groups (parameter names and hyper-parameters). A stage may hold a group
empty or not at all (transformers' Trainer keeps an empty no-decay group, `optimizer_for_mp` drops one), and two
groups may share their hyper-parameters (the Trainer's decay / no-decay groups at weight_decay=0), so neither the count
nor the position of groups says which saved group a running one is: each parameter's name does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..io.errors import CheckpointError
from .metadata import CheckpointIndex
from .sharding import assign_pp_ranks


def _hyper(group: Mapping) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def _merge_by_position(per_rank: list[list[dict]], canonical: Callable[[str], str]) -> list[dict] | None:
    """Group i of every stage is one group (every stage lists the same number, as the Trainer's do): its parameters
    over all stages, its hyper-parameters from a stage where it holds some. None when the counts differ, or when the
    groups at one position disagree (stages that dropped different empty groups)."""
    if len({len(groups) for groups in per_rank}) != 1:
        return None
    merged = []
    for column in zip(*per_rank, strict=True):
        held = [g for g in column if g["params"]] or list(column)
        if any(_hyper(g) != _hyper(held[0]) for g in held):
            return None
        names = list(dict.fromkeys(canonical(n) for g in column for n in g["params"]))
        merged.append({**_hyper(held[0]), "params": names})
    return merged


def _merge_by_hyper(per_rank: list[list[dict]], canonical: Callable[[str], str]) -> list[dict]:
    """Stages whose group lists differ (empty groups dropped on some): groups with equal hyper-parameters are one
    (the same update whichever group a parameter is in)."""
    merged: list[dict] = []
    for groups in per_rank:
        for group in groups:
            same = next((g for g in merged if _hyper(g) == _hyper(group)), None)
            if same is None:
                same = {**_hyper(group), "params": []}
                merged.append(same)
            same["params"] += [n for n in map(canonical, group["params"]) if n not in same["params"]]
    return merged


def regroup(index: CheckpointIndex, pp: int) -> dict[str, list[dict]]:
    """The optimizer's param groups per pp rank at `pp` stages (split as `parallelize` splits the layers). Groups
    keep their order and hyper-parameters; where every source stage listed the same groups each target stage lists
    them all (empty ones too), else empty groups are dropped. A weight tied across stages (embedding / LM head) is in
    both stages' groups, under each stage's name."""
    saved, tied = index.optimizer["param_groups"], index.tied
    per_rank = [saved[r] for r in sorted(saved, key=int)]

    def canonical(name: str) -> str:  # one name per tied weight, whichever stage listed it
        return tied.get(name, name)

    merged = _merge_by_position(per_rank, canonical)
    keep_empty = merged is not None
    merged = merged if merged is not None else _merge_by_hyper(per_rank, canonical)
    alias_of = {c: a for a, c in tied.items() if c in index.tensors and a not in index.tensors}
    stage_of = assign_pp_ranks([*index.tensors, *alias_of.values()], pp)
    groups: dict[str, list[dict]] = {}
    for rank in range(pp):
        groups[str(rank)] = []
        for group in merged:
            names = []
            for name in group["params"]:
                alias = alias_of.get(name)
                if stage_of[name] == rank:
                    names.append(name)
                elif alias is not None and stage_of[alias] == rank:  # the other side of a tie, where it was
                    names.append(alias)
            if names or keep_empty:
                groups[str(rank)].append({**_hyper(group), "params": names})
    return groups


def saved_hyper_parameters(where: str, saved: list[dict], groups: list[list[str]]) -> list[dict | None]:
    """For each running param group (by its parameters' names), the saved hyper-parameters it resumes with: those of
    the saved group(s) its parameters were in, which must agree. An empty group takes the saved group at its
    position where the saved list is as long (None: it keeps its own). Every saved parameter must be in a group."""
    group_of = {name: i for i, group in enumerate(saved) for name in group["params"]}
    held = {name for names in groups for name in names}
    only_saved = sorted(set(group_of) - held)
    if only_saved:
        raise CheckpointError(
            f"{where}: the optimizer state of {len(only_saved)} parameters is saved for this pipeline rank but the "
            f"optimizer holds none of them: {only_saved[:3]}"
        )
    hypers: list[dict | None] = []
    for i, names in enumerate(groups):
        missing = [n for n in names if n not in group_of]
        if missing:
            raise CheckpointError(
                f"{where}: optimizer param group {i} holds {len(missing)} parameters the checkpoint has no optimizer "
                f"state for on this pipeline rank: {missing[:3]}"
            )
        found = {group_of[n] for n in names}
        distinct = {repr(sorted(_hyper(saved[j]).items())): j for j in sorted(found)}
        if len(distinct) > 1:
            shown = "; ".join(f"{_hyper(saved[j])}" for j in distinct.values())
            raise CheckpointError(
                f"{where}: optimizer param group {i} holds parameters saved in groups with different "
                f"hyper-parameters ({shown}); group the parameters as when the checkpoint was saved"
            )
        if found:
            hypers.append(_hyper(saved[min(found)]))
        else:
            hypers.append(_hyper(saved[i]) if len(saved) == len(groups) else None)
    return hypers
