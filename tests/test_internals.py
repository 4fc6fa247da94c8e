"""Every private transformers/accelerate symbol the package relies on exists as expected, and a changed one fails
with a message naming it, the installed version and the feature that needs it."""

from __future__ import annotations

import pytest

from optimum_parallel.integrations.transformers import internals
from optimum_parallel.integrations.transformers.internals import (
    Internal,
    InternalsChanged,
    check_internals,
    check_overrides,
    private_override,
    transformers_internal,
)


def test_installed_transformers_has_every_internal_we_use():
    assert check_internals() == []


def test_trainer_overrides_still_match_transformers():
    from transformers import Trainer

    from optimum_parallel.integrations.transformers.trainer import ParallelTrainerMixin

    check_overrides(ParallelTrainerMixin, Trainer)  # also run when a ParallelTrainer is made
    overridden = [name for name, f in vars(ParallelTrainerMixin).items() if getattr(f, "__private_override__", False)]
    assert len(overridden) >= 11


def test_a_missing_symbol_names_itself_the_version_and_the_feature(monkeypatch):
    monkeypatch.setitem(
        internals.INTERNALS,
        "gone",
        Internal("transformers.modeling_utils", "PreTrainedModel._no_such_method", "the feature that needs it"),
    )
    with pytest.raises(
        InternalsChanged,
        match=r"transformers \d.*PreTrainedModel\._no_such_method no longer exists.*"
        r"the feature that needs it",
    ):
        transformers_internal("gone")


def test_a_changed_signature_is_reported(monkeypatch):
    monkeypatch.setitem(
        internals.INTERNALS,
        "moved",
        Internal("transformers.modeling_utils", "PreTrainedModel._from_config", "lazy from_config", ("cfg",)),
    )
    with pytest.raises(InternalsChanged, match=r"_from_config takes \(config.*expected \(cfg"):
        transformers_internal("moved")


def test_overrides_of_vanished_or_shadowed_methods_are_refused():
    class Base:
        def _kept(self, x):
            return x

    class Vanished(Base):
        @private_override
        def _renamed_upstream(self, x):
            return x

    class Shadowing(Base):
        def _kept(self, x):
            return x

    class Changed(Base):
        @private_override
        def _kept(self, y):
            return y

    with pytest.raises(InternalsChanged, match="_renamed_upstream no longer exists"):
        check_overrides(Vanished, Base)
    with pytest.raises(InternalsChanged, match="shadows .*_kept: mark it @private_override"):
        check_overrides(Shadowing, Base)
    with pytest.raises(InternalsChanged, match=r"_kept now takes \(self, x\)"):
        check_overrides(Changed, Base)


def test_accelerate_keeps_its_prepared_data_loaders_in_a_list():
    from accelerate import Accelerator

    from optimum_parallel.integrations.transformers.trainer import _register_data_loader

    accelerator = Accelerator(cpu=True)
    _register_data_loader(accelerator, "loader")
    assert accelerator._dataloaders[-1] == "loader"

    class Changed:
        _dataloaders = None

    with pytest.raises(InternalsChanged, match="no `_dataloaders` list"):
        _register_data_loader(Changed(), "loader")
