"""The optimizer of an expert-parallel model at sharding level 1: two ZeRO-1 optimizers stepped as one, the dense
parameters' state sharded over dp x cp and the experts' over their replica group (the ranks holding the same
experts). Its state dict speaks of the param groups as the caller built them, so a checkpoint does not depend on
the level (`checkpoint.collect` reads the parts' state through `parts` and `source_param_groups`)."""

from __future__ import annotations

from typing import Any

import torch


class ExpertSplitOptimizer(torch.optim.Optimizer):
    """`parts` (ZeRO-1 optimizers) stepped as one. `param_groups` are theirs (the same dicts: a scheduler's lr
    reaches both); `origins[k][j]` is the index of the caller's param group that part k's group j came from, and
    `source_groups` the caller's groups (their parameters in order, which state dicts index, and their options,
    kept for a group no part holds: an empty one)."""

    def __init__(
        self, parts: list[torch.optim.Optimizer], origins: list[list[int]], source_groups: list[dict[str, Any]]
    ) -> None:
        self.parts, self.origins = parts, origins
        self.source_params = [list(group["params"]) for group in source_groups]
        self._source_options = [{k: v for k, v in group.items() if k != "params"} for group in source_groups]
        groups = [group for part in parts for group in part.param_groups]
        super().__init__(groups, parts[0].defaults)  # the same group dicts, appended as they are

    @property
    def state(self):  # the local optimizers' state (a fresh one holds none)
        return {k: v for part in self.parts for k, v in part.optim.state.items()}

    @state.setter
    def state(self, _value) -> None:  # Optimizer.__init__ assigns an empty one
        pass

    @property
    def source_param_groups(self) -> list[dict[str, Any]]:
        """The param groups as the caller built them: their parameters, and the options of the parts' groups made
        from them (the same in every part)."""
        options: dict[int, dict] = {}
        for part, origins in zip(self.parts, self.origins, strict=True):
            for group, origin in zip(part.param_groups, origins, strict=True):
                options.setdefault(origin, {k: v for k, v in group.items() if k != "params"})
        return [
            {**options.get(i, self._source_options[i]), "params": list(params)}
            for i, params in enumerate(self.source_params)
        ]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather each part's state on its group's rank `to` (a collective of both groups: call it on every rank).
        With `to=0` the dp x cp rank 0 receives the state of all its parameters (the dense ones and its experts)."""
        for part in self.parts:
            part.consolidate_state_dict(to=to)

    def state_dict(self) -> dict[str, Any]:
        """The state of this rank's parameters (the dense ones and its experts), indexed like the caller's param
        groups, as a plain optimizer over them gives it; `consolidate_state_dict` must have gathered it here."""
        index = {id(p): i for i, p in enumerate(p for params in self.source_params for p in params)}
        state: dict[int, Any] = {}
        for part in self.parts:
            try:
                consolidated = part.state_dict()
            except RuntimeError as err:
                raise RuntimeError(
                    "the state of an expert-parallel model's optimizer at sharding_level=1 is spread over two ZeRO-1 "
                    "groups: call consolidate_state_dict(to=0) on every rank first, then state_dict() on dp x cp "
                    f"rank 0 ({err})"
                ) from None
            params = [p for group in part.param_groups for p in group["params"]]
            for i, value in consolidated["state"].items():
                if value:
                    state[index[id(params[i])]] = value
        groups, position = [], 0
        for group in self.source_param_groups:
            ids = list(range(position, position + len(group["params"])))
            groups.append({**group, "params": ids})
            position += len(ids)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict indexed like the caller's param groups (what `state_dict` or a plain optimizer over the
        same parameters gives): each part keeps its share, and every group takes the saved options."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.source_params) or any(
            len(g["params"]) != len(p) for g, p in zip(saved, self.source_params, strict=True)
        ):
            raise ValueError(
                f"loaded state dict has param groups of sizes {[len(g['params']) for g in saved]}, the optimizer's "
                f"are {[len(p) for p in self.source_params]}"
            )
        by_param = {
            id(param): state_dict["state"][i]
            for group, params in zip(saved, self.source_params, strict=True)
            for i, param in zip(group["params"], params, strict=True)
            if i in state_dict["state"]
        }
        for part, origins in zip(self.parts, self.origins, strict=True):
            state, groups, position = {}, [], 0
            for group, origin in zip(part.param_groups, origins, strict=True):
                for param in group["params"]:
                    if id(param) in by_param:
                        state[position] = by_param[id(param)]
                    position += 1
                options = {k: v for k, v in saved[origin].items() if k != "params"}
                groups.append({**options, "params": list(range(position - len(group["params"]), position))})
            part.load_state_dict({"state": state, "param_groups": groups})
