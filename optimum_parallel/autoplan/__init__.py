"""Plans from a model's structure: the automatic families (transformers' `base_model_tp_plan`, vision-language
models), their sequence-parallel, mixer and activation entries."""
