"""A vision-language policy for ParallelDPOTrainer / ParallelKTOTrainer (a tiny Qwen2.5-VL, tp=2, gloo, 2 ranks): TRL's
vision-language path (a multimodal processor as `processing_class`, or `image` / `images` rows) is refused by name on
every rank at construction, before any checkpoint is loaded (the `model_class` given raises if it is asked to load).
Not trained against TRL: that path is not shown to give TRL's figures on a parallel policy."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from transformers import ProcessorMixin  # noqa: E402

WORLD_SIZE = 2
TP2 = {"tensor_parallel_size": 2}


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> str:
    from _dpo import make_tokenizer
    from _vlm import VOCAB, save_tiny_vlm

    path = save_tiny_vlm(tmp_path_factory.mktemp("hf") / "qwen2_5_vl", "qwen2_5_vl")
    make_tokenizer(VOCAB).save_pretrained(path)
    return path


class VLProcessor(ProcessorMixin):
    """A multimodal processor as far as the refusal looks (Qwen2.5-VL's own needs Pillow and torchvision)."""

    def __init__(self) -> None:
        pass


class NotLoaded:
    """`model_class` that fails if anything is loaded: the refusal must come first."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        raise RuntimeError("a checkpoint was loaded before the refusal")


def image_rows(kind: str) -> list[dict]:
    image = [[[0, 0, 0]] * 4] * 4  # a 4 x 4 RGB image as a dataset stores it
    prompt = "t130 t128 t128 t128 t128 t131 t5 t6"
    if kind == "kto":
        return [{"images": [image], "prompt": prompt, "completion": " t7", "label": i % 2 == 0} for i in range(4)]
    return [{"image": image, "prompt": prompt, "chosen": " t7", "rejected": " t8"}] * 4


def refused(model_dir: str, output_dir: str, trainer: str, what: str) -> str:
    from _dpo import dpo_args, preference_dataset
    from _kto import unpaired_dataset
    from datasets import Dataset
    from transformers import AutoTokenizer

    from optimum_parallel.integrations import trl as op_trl

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = preference_dataset(128) if trainer == "dpo" else unpaired_dataset(128)
    processor = tokenizer
    if what == "processor":
        processor = VLProcessor()
    else:
        rows = Dataset.from_list(image_rows(trainer))
    config, cls = ((op_trl.ParallelDPOConfig, op_trl.ParallelDPOTrainer) if trainer == "dpo"
                   else (op_trl.ParallelKTOConfig, op_trl.ParallelKTOTrainer))  # fmt: skip
    try:
        args = config(**dpo_args(output_dir, **TP2))
        cls(model_dir, args=args, train_dataset=rows, processing_class=processor, model_class=NotLoaded)
    except (ValueError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize("trainer", ["dpo", "kto"])
@pytest.mark.parametrize(
    "what,words",
    [("processor", "processing_class=VLProcessor (a multimodal processor"), ("images", "column (vision-language")],
)
def test_vision_language_policies_are_refused_by_name_on_every_rank(pool, vlm_dir, tmp_path, trainer, what, words):
    name = "ParallelDPOTrainer" if trainer == "dpo" else "ParallelKTOTrainer"
    for message in pool.run(refused, vlm_dir, str(tmp_path), trainer, what):
        assert message.startswith("ValueError") and words in message and name in message, message
        assert "allowed: " in message, message
