"""A training run: its configuration (config.py: RunConfig, validated once per process boundary), the one resolve
before it starts (preflight.py), and the loop (loop.py: run_training) with the steps it calls: the rollout fan-out
and weight push (rollouts.py), the scored batch with DAPO's refill and the evaluation (scoring.py), the policy and
its optimizer step (policy.py), and where the numbers go (metrics.py)."""
