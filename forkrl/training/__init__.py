"""A training run: its configuration and the loop that turns rollouts into optimizer steps and pushes."""
