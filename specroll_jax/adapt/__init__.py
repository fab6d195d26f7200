"""Head adaptation on two timescales: Reflex (inside the rollout) and the slow path
(monitor + consolidation between batches), with self-distillation as their shared loss."""
