"""Speculative decoding: cheap proposers of draft tokens (n-gram prompt lookup, suffix decoding) whose drafts
the target model verifies in its normal batched step.

- config.py: vLLM's SpeculativeConfig fields, validated (no torch).
- ngram.py, suffix.py: the proposers (no torch).
- speculator.py: what the scheduler asks: drafts per request, adaptivity, acceptance counters (no torch).
- verify.py: the model runner's side: logits at every draft position, acceptance (torch).
"""
