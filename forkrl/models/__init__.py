"""Models: the embedded tiny default (builder) and the one batched KV-cache sampler used off the engine."""
