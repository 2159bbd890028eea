"""The engine every node runs: configs, requests, block pool and KV-cache manager, scheduler,
model runner, sampler, the engine step (LLMEngine) and the offline LLM.

Scheduling and block bookkeeping are pure Python; only the model runner touches tensors.
"""
