"""forkrl: RL from verifiable rewards with the policy gradient restricted to the forking tokens.

The core package: entropy, the forking-token mask, advantages and losses, tasks, rewards, the tiny
default model, weight (de)serialization and the generated protocol code. It never imports a server.
"""

__version__ = "0.1.0"
