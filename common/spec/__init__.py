"""Speculative decoding's drafters: `SpeculativeConfig` (vLLM's --speculative-config) and the
model-free proposers (`ngram` prompt lookup, `suffix` decoding), pure Python, no torch. The
engine asks a `Proposer` for draft tokens each decode step and verifies them in one forward."""
