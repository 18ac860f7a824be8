"""RayFlowGRPOTrainer (a subclass of verl's RayPPOTrainer), prompt dataset, metrics and validation."""
