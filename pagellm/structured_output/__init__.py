"""Constrained decoding (structured outputs) on xgrammar: grammars compiled once per schema off the engine
thread, one matcher per sequence in the model runner, a per-step allowed-token bitmask."""
