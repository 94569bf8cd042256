"""trainer_service: a gRPC service that owns RL runs (see proto/forkrl/trainer/v1/trainer.proto)."""
