"""What a run reports about itself: flops (the FLOPs model and the device peak that MFU is taken against), logger
(metrics.jsonl, console, wandb), memory (peak memory, live tensor bytes) and profiling (train.profile_steps).
Nothing is imported here, so the planner can read the FLOPs model without the logger's imports."""
