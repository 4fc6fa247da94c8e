"""Vision-language models under pipeline parallelism (and Qwen3-VL under sequence parallelism) against the real
single-device transformers model on the whole batch (gloo, 4 ranks).

The first stage runs the vision tower and projector on each micro-batch's own images and merges their features into
the input embeddings; what the later stages need travels with the hidden states: the M-RoPE positions (Qwen), Gemma
3's token_type_ids (its image blocks' mask is built on every stage), Qwen3-VL's deepstack features while a later stage
holds a layer they are added to. The batches carry padding, -100 labels, rows with no image and rows with two, images
of different sizes, so micro-batches hold different numbers of images and of labelled tokens. Checked: the loss,
every gradient (the vision tower's included, each parameter on the rank that holds it, every parameter on some rank),
the loss over 3 AdamW steps and `run_eval`'s logits, within 1e-5 or twice the fp32 noise floor where that is higher
(the same one-process run from weights perturbed by a relative 1e-7).
"""

from __future__ import annotations

import copy
from functools import cache

import pytest
import torch
import torch.distributed as dist
from _models import rel_err
from _vlm import END, IMAGE, QWEN_GRIDS, START, TINY_VLM_CONFIGS, TOL, load_vlm
from transformers import AutoModelForImageTextToText

WORLD_SIZE = 4
LR = 1e-3
STEPS = 3
# per row: left padding, text tokens before the first image, images
ROWS = [
    dict(pad=3, before=3, images=1),
    dict(pad=0, before=4, images=0),
    dict(pad=1, before=12, images=2),  # the second image across the middle of the sequence (sp's two halves)
    dict(pad=0, before=15, images=1),
]


def _image(config, index: int, gen: torch.Generator) -> tuple[list[int], torch.Tensor, tuple | None]:
    """One image's placeholder tokens, pixels and grid (Qwen), as its processor gives them."""
    vision = config.vision_config
    if config.model_type == "llava":
        size = vision.image_size
        return [IMAGE] * (size // vision.patch_size) ** 2, torch.randn(1, 3, size, size, generator=gen), None
    if config.model_type == "gemma3":
        size = vision.image_size
        tokens = [START] + [IMAGE] * config.mm_tokens_per_image + [END]
        return tokens, torch.randn(1, 3, size, size, generator=gen), None
    t, h, w = QWEN_GRIDS[index % len(QWEN_GRIDS)]
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    tokens = [START] + [IMAGE] * (t * h * w // vision.spatial_merge_size**2) + [END]
    return tokens, torch.randn(t * h * w, width, generator=gen), (t, h, w)


def vlm_batch(config, rows: list[dict] = ROWS, seed: int = 1, seq: int | None = None) -> dict:
    """Rows of text and images (`ROWS`), left-padded, labels -100 at padding, image tokens and one more place; a
    multiple of 8 tokens, at least 8 of them text after the last image."""
    gen = torch.Generator().manual_seed(seed)
    ids, pixels, grids, count = [], [], [], 0
    for spec in rows:
        row = [0] * spec["pad"] + [1] + torch.randint(3, 128, (spec["before"],), generator=gen).tolist()
        for _ in range(spec["images"]):
            tokens, image, grid = _image(config, count, gen)
            row += tokens + torch.randint(3, 128, (2,), generator=gen).tolist()
            pixels.append(image)
            grids += [grid] if grid else []
            count += 1
        ids.append(row)
    seq = seq or -(-(max(len(row) for row in ids) + 8) // 8) * 8
    ids = [row + torch.randint(3, 128, (seq - len(row),), generator=gen).tolist() for row in ids]
    input_ids = torch.tensor(ids)
    pads = torch.tensor([spec["pad"] for spec in rows])
    attention_mask = (torch.arange(seq) >= pads[:, None]).long()
    labels = input_ids.masked_fill((attention_mask == 0) | (input_ids == IMAGE), -100)
    labels[:, 1:][attention_mask[:, :-1] == 0] = -100  # predicted from a padding position
    labels[:, seq // 2 + 1] = -100
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "pixel_values": torch.cat(pixels),
    }
    types = (input_ids == IMAGE).long()
    if grids:
        batch["image_grid_thw"] = torch.tensor(grids)
        batch["mm_token_type_ids"] = types
    if config.model_type == "gemma3":
        batch["token_type_ids"] = types
    return batch


def save_vlm(directory, model_type: str, **overrides) -> str:
    """A tiny VLM (tests/_vlm.py), its zero-initialised parameters given small random values (a bias at zero checks
    nothing on the first step), with config overrides (`text_config.num_hidden_layers`, ...)."""
    config = TINY_VLM_CONFIGS[model_type]()
    for key, value in overrides.items():
        target, _, attribute = key.rpartition(".")
        setattr(_sub(config, target), attribute, value)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            if not param.any():
                param.copy_(0.02 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(directory)
    return str(directory)


def _sub(config, path: str):
    for part in filter(None, path.split(".")):
        config = getattr(config, part)
    return config


def _module_scales(model) -> dict[str, float]:
    """The largest gradient of each module: a gradient's error is measured on its module's scale (a key bias's
    analytically-zero gradient is rounding noise)."""
    scales: dict[str, float] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.grad is not None:
            owner = name.rpartition(".")[0]
            scales[owner] = max(scales.get(owner, 0.0), param.grad.abs().max().item())
    return scales


def _err(actual, expected, scale: float) -> float:
    return ((actual.detach().double() - expected.detach().double()).abs().max() / max(scale, 1e-30)).item()


@cache
def noise_floor(model_dir: str, batch_key: str) -> float:
    """Twice the largest error of one process against itself from weights perturbed by a relative 1e-7."""
    batch = BATCHES[batch_key]
    reference, perturbed = load_vlm(model_dir), load_vlm(model_dir)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in perturbed.parameters():
            param.mul_(1 + 1e-7 * torch.randn(param.shape, generator=gen))
    errors = []
    for model in (reference, perturbed):
        model(**batch).loss.backward()
    scales = _module_scales(reference)
    grads = dict(perturbed.named_parameters())
    for name, param in reference.named_parameters():
        if param.grad is not None:
            errors.append(_err(grads[name].grad, param.grad, scales[name.rpartition(".")[0]]))
    losses = [reference(**batch).loss, perturbed(**batch).loss]
    errors.append(rel_err(losses[1], losses[0]))
    return 2 * max(errors)


BATCHES: dict[str, dict] = {}


def check_vlm_pipeline(
    model_dir: str,
    batches: list[dict],
    *,
    pp: int = 2,
    tp: int = 1,
    microbatches: int = 2,
    schedule: str = "1f1b",
    level: int = 0,
    sequence_parallel: bool = False,
) -> dict:
    """One layout against one process on the whole batch (`batches`: one per dp replica, concatenated for the
    reference): loss, every gradient this rank holds, `run_eval`'s logits and loss, the loss over `STEPS` AdamW
    steps."""
    from test_expert_parallel_layouts import reference_slice, whole

    import optimum_parallel as op
    from optimum_parallel.engine.compose import compose_training

    dp = dist.get_world_size() // (pp * tp)
    mesh = op.init_mesh(dp=dp, pp=pp, tp=tp, timeout=60)
    reference = load_vlm(model_dir)
    model = copy.deepcopy(reference)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
    parallelizer = op.ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(
        model,
        sequence_parallel_enabled=sequence_parallel,
        pipeline_parallel_num_microbatches=microbatches,
        pipeline_parallel_schedule=schedule,
    )
    optimizer = parallelizer.optimizer_for_mp(optimizer, model.orig_param_to_parallel_param)
    model, optimizer = compose_training(model, optimizer, mesh, {}, op.DataParallelConfig(level))
    local = batches[mesh.rank("dp")]
    whole_batch = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}

    def step() -> float:
        ref_loss = reference(**whole_batch).loss
        ref_loss.backward()
        if pp > 1:
            loss = model.run_train(**local)
        else:
            loss = model(**local).loss
            loss.backward()
        return rel_err(loss, ref_loss)

    losses = [step()]
    scales = _module_scales(reference)
    expected = dict(reference.named_parameters(remove_duplicate=False))  # a tied LM head too
    grads, held = {}, []
    for name, param in model.named_parameters(remove_duplicate=False):
        held.append(name)
        want = expected[name].grad
        if param.grad is None or want is None:
            assert param.grad is None and want is None, f"{name}: a gradient on one side only"
            continue
        grads[name] = _err(whole(param.grad), reference_slice(param, want), scales[name.rpartition(".")[0]])
    with torch.no_grad():
        evaluated = model.run_eval(**local) if pp > 1 else model(**local)
        ref_eval = reference(**local)
    ref_logits, eval_loss = ref_eval.logits, rel_err(evaluated.loss, ref_eval.loss)
    logits = 0.0
    if evaluated.logits is not None:  # the last stage's, the whole vocabulary under tp too
        assert evaluated.logits.shape == ref_logits.shape, (evaluated.logits.shape, ref_logits.shape)
        real = local["attention_mask"].bool()
        logits = rel_err(evaluated.logits[real], ref_logits[real])
    for _ in range(STEPS):
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
        losses.append(step())
    worst = max(grads, key=grads.get)
    return {
        "loss": losses[0],
        "steps": max(losses[1:]),
        "grad": grads[worst],
        "worst": worst,
        "logits": logits,
        "eval_loss": eval_loss,
        "held": held,
    }


def assert_equal(results: list[dict], model_dir: str, batch_key: str, reference_names: list[str]) -> float:
    tol = max(TOL, noise_floor(model_dir, batch_key))
    for rank, result in enumerate(results):
        worst = max(result[key] for key in ("loss", "steps", "grad", "logits", "eval_loss"))
        assert worst <= tol, (
            f"rank {rank}: {worst:.2e} > {tol:.2e}: { {k: v for k, v in result.items() if k != 'held'} }"
        )
    held = {name for result in results for name in result["held"]}
    assert held >= set(reference_names), f"held by no rank: {sorted(set(reference_names) - held)}"
    return max(max(r["loss"], r["steps"], r["grad"], r["logits"]) for r in results)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_pp")
    dirs = {t: save_vlm(root / t, t) for t in TINY_VLM_CONFIGS if t != "qwen3_vl_moe"}
    # Gemma 3 with its LM head tied to the token embedding (first and last stage hold the one weight)
    dirs["gemma3_tied"] = save_vlm(root / "gemma3_tied", "gemma3", tie_word_embeddings=True)
    # deepstack features added after layers 0 and 1: layer 1 lives on the second stage, they travel there
    dirs["qwen3_vl_deep"] = save_vlm(
        root / "qwen3_vl_deep", "qwen3_vl", **{"vision_config.deepstack_visual_indexes": [0, 1]}
    )
    # four layers, deepstack after 0, 1 and 2: two stages per rank, the features travel over three stages
    dirs["qwen3_vl_4"] = save_vlm(
        root / "qwen3_vl_4",
        "qwen3_vl",
        **{
            "text_config.num_hidden_layers": 4,
            "vision_config.depth": 3,
            "vision_config.deepstack_visual_indexes": [0, 1, 2],
        },
    )
    return dirs


def _names(model_dir: str) -> list[str]:
    return [name for name, _ in load_vlm(model_dir).named_parameters(remove_duplicate=False)]


def _batch(model_dir: str, key: str, **kwargs) -> dict:
    if key not in BATCHES:
        config = load_vlm(model_dir).config
        BATCHES[key] = vlm_batch(config, **kwargs)
    return BATCHES[key]


PP_TP = ["llava", "gemma3_tied", "qwen2_5_vl", "qwen3_vl_deep", "qwen3_5"]


@pytest.mark.parametrize("name", PP_TP)
def test_vlm_pp2_tp2_matches_single_device(pool, model_dirs, name):
    """pp=2 x tp=2, 4 micro-batches of one row (one without an image, one with two)."""
    batch = _batch(model_dirs[name], name)
    results = pool.run(check_vlm_pipeline, model_dirs[name], [batch], tp=2, microbatches=4)
    print(name, "pp2 x tp2", assert_equal(results, model_dirs[name], name, _names(model_dirs[name])))


DP_CASES = [("qwen3_vl_deep", 0), ("gemma3", 3), ("llava", 3), ("qwen2_5_vl", 0)]


@pytest.mark.parametrize("name,level", DP_CASES)
def test_vlm_pp2_dp2_matches_whole_batch(pool, model_dirs, name, level):
    """dp=2 x pp=2 at sharding level 0 (the pipeline's own gradient averaging) and 3 (FSDP2): each dp replica its own
    half of the batch (different images), the reference the whole batch."""
    config = load_vlm(model_dirs[name]).config
    seq = vlm_batch(config)["input_ids"].shape[1]
    halves = [vlm_batch(config, ROWS[:2], seed=1, seq=seq), vlm_batch(config, ROWS[2:], seed=2, seq=seq)]
    key = f"{name}-halves"
    BATCHES[key] = {k: torch.cat([h[k] for h in halves]) for k in halves[0]}
    results = pool.run(check_vlm_pipeline, model_dirs[name], halves, level=level)
    print(name, "dp2 x pp2 level", level, assert_equal(results, model_dirs[name], key, _names(model_dirs[name])))


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv"])
def test_vlm_two_stages_per_rank(pool, model_dirs, schedule):
    """Qwen3-VL with four layers, two stages per rank (its deepstack features added after layers 0-2, travelling over
    three stages), pp=2 x tp=2, 2 micro-batches."""
    name = "qwen3_vl_4"
    batch = _batch(model_dirs[name], name)
    results = pool.run(check_vlm_pipeline, model_dirs[name], [batch], tp=2, schedule=schedule)
    print(name, schedule, assert_equal(results, model_dirs[name], name, _names(model_dirs[name])))


@pytest.mark.parametrize("name", ["qwen3_vl_deep"])
def test_qwen3_vl_pp2_tp2_sequence_parallel(pool, model_dirs, name):
    """pp=2 x tp=2 with sequence parallelism: the deepstack features split along the sequence with the hidden states
    (images across the middle of the sequence), on the stage holding their layer."""
    batch = _batch(model_dirs[name], name)
    results = pool.run(check_vlm_pipeline, model_dirs[name], [batch], tp=2, sequence_parallel=True)
    print(name, "pp2 x tp2 + sp", assert_equal(results, model_dirs[name], name, _names(model_dirs[name])))


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen3_vl_deep"])
def test_qwen3_vl_tp4_sequence_parallel(pool, model_dirs, name):
    """tp=4 with sequence parallelism (no pipeline): four slices of the sequence, images across their borders."""
    batch = _batch(model_dirs[name], name)
    results = pool.run(
        check_vlm_pipeline, model_dirs[name], [batch], pp=1, tp=4, microbatches=1, sequence_parallel=True
    )
    print(name, "tp4 + sp", assert_equal(results, model_dirs[name], name, _names(model_dirs[name])))


def check_vlm_lazy_pipeline(model_dir: str, batch: dict) -> dict:
    """pp=2 x tp=2 from a lazy load: each rank reads its stage's slices only (the vision tower on the first stage's
    ranks only), exactly the checkpoint's, and the first step's loss is one process's."""
    import optimum_parallel as op
    import optimum_parallel.engine.materialize as lazy

    mesh = op.init_mesh(pp=2, tp=2, timeout=60)
    reference = load_vlm(model_dir)
    with op.lazy_load_for_parallelism(tensor_parallel_size=2, pipeline_parallel_size=2):
        model = AutoModelForImageTextToText.from_pretrained(model_dir, attn_implementation="eager")
    model.eval()
    meta = all(p.device.type == "meta" for p in model.parameters())
    read, original = [], lazy.read_slice
    lazy.read_slice = lambda *args: read.append(original(*args)) or read[-1]
    try:
        model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(
            model, pipeline_parallel_num_microbatches=2
        )
    finally:
        lazy.read_slice = original
    ref_params = dict(reference.named_parameters())
    names = [name for name, _ in model.named_parameters()]
    exact = all(
        torch.equal(p, p.shard_layout.slice(ref_params[n]) if hasattr(p, "shard_layout") else ref_params[n])
        for n, p in model.named_parameters()
    )
    loss = rel_err(model.run_train(**batch), reference(**batch).loss)
    return {
        "stage": mesh.rank("pp"),
        "meta_before": meta,
        "exact": exact,
        "read": sum(t.numel() for t in read),
        "local": sum(p.numel() for p in model.parameters()),
        "vision": sum(1 for n in names if n.startswith(("model.visual.", "model.vision_tower."))),
        "loss": loss,
    }


@pytest.mark.parametrize("name", ["qwen3_vl", "llava"])
def test_vlm_lazy_load_reads_each_stage_only(pool, model_dirs, name):
    batch = _batch(model_dirs[name], name)
    results = pool.run(check_vlm_lazy_pipeline, model_dirs[name], batch)
    for rank, result in enumerate(results):
        assert result["meta_before"] and result["exact"], (rank, result)
        assert result["read"] == result["local"], f"rank {rank} read more than its stage's slices: {result}"
        assert (result["vision"] > 0) == (result["stage"] == 0), f"rank {rank}: vision tower on stage {result}"
        assert result["loss"] <= TOL, (rank, result)
    print(name, "lazy pp2 x tp2", results)


def refusal(model_dir: str, sizes: dict) -> str | None:
    import optimum_parallel as op

    op.init_mesh(**sizes, timeout=60)
    model = load_vlm(model_dir)
    try:
        op.ParallelizersManager.parallelizer_for_model(model).parallelize(model)
    except (NotImplementedError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def check_bad_image_tokens(model_dir: str, batch: dict) -> str | None:
    import optimum_parallel as op

    op.init_mesh(pp=2, tp=2, timeout=60)
    model = load_vlm(model_dir)
    model = op.ParallelizersManager.parallelizer_for_model(model).parallelize(
        model, pipeline_parallel_num_microbatches=2
    )
    try:
        model.run_train(**batch)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("name", ["llava", "qwen2_5_vl"])
def test_vlm_pipeline_image_tokens_not_matching_the_images_raise_on_every_rank(pool, model_dirs, name):
    batch = dict(_batch(model_dirs[name], name))
    ids = batch["input_ids"].clone()
    ids[0, (ids[0] == IMAGE).nonzero()[0]] = 5  # one placeholder token less in row 0
    batch["input_ids"] = ids
    messages = pool.run(check_bad_image_tokens, model_dirs[name], batch)
    assert messages[0] is not None and "image tokens" in messages[0], messages
    assert len(set(messages)) == 1, messages
    print(name, messages[0])
