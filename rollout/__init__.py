"""Plain PyTorch + diffusers rollout engine: sampling with exact trajectories, replay and codec."""
