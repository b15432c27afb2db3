"""Speculative decoding: proposers of draft tokens (n-gram prompt lookup, suffix decoding, a draft model, an MTP
or EAGLE head) whose drafts the target model verifies in its normal batched step.

- config.py: vLLM's SpeculativeConfig fields, validated (no torch).
- ngram.py, suffix.py: the proposers (no torch).
- speculator.py: what the scheduler asks: drafts per request, adaptivity, acceptance counters (no torch).
- draft_model.py: the draft model's proposer, run by the model runner before the target's forward, and its share
  of the KV pool (torch).
- heads.py: the MTP / EAGLE heads' proposer, run by the model runner before the target's forward (drafts) and
  after it (catch-up over the target's hidden states), and the heads' loading; mtp.py, eagle.py: the heads (torch).
- verify.py: the model runner's side: logits at every draft position, acceptance (torch).
"""
