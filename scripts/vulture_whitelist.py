"""Names `vulture optimum_parallel --min-confidence 80` reports as unused that a protocol or a caller requires; read by
vulture (`make lint`), never run. Each is a parameter kept for its signature's sake, not dead code.

    vulture optimum_parallel scripts/vulture_whitelist.py --min-confidence 80
"""

# ruff: noqa: B018, F821

# `__exit__(self, *exc)`: the context-manager protocol passes the exception triple; closing ignores it
# (checkpoint/reading.py, io/safetensors_io.py, plan/caller_outputs.py)
exc

# Parallelizer.parallelize: optimum-neuron's parameter, accepted for compatibility (public API, DESIGN.md)
pipeline_parallel_use_zero1_optimizer

# lazy_loading._record_instead_of_loading stands in for PreTrainedModel._load_pretrained_model: same parameters
expected_keys

# ParallelTrainer._prepare_data_loader overrides accelerate's method: its callers pass these
device_placement

# ParallelTrainer._gather_over_dp stands in for accelerate's gather_for_metrics(data, use_gather_object=False), keeping
# its signature; transformers' evaluation loop passes tensors only
use_gather_object

# ParallelGRPOTrainer._get_per_token_logps_and_entropies overrides trl's method, whose callers pass the image inputs
# of vision-language models by keyword: these two are counts that come with pixel_values, which the override refuses
num_images
num_tiles
