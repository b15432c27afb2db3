"""Fixed texts the benchmarks score (perplexity), so that figures from different runs and formats compare."""

# Plain English prose about the engine's subject, about 600 tokens in the default model's tokenizer.
PERPLEXITY_TEXT = """\
When a language model answers a question, it writes one token at a time, and every new token looks back at all
the tokens before it. To avoid computing the same keys and values again and again, a serving engine keeps them in
memory, in what is called the key-value cache. For a long conversation this cache grows large, and for many
conversations at once it becomes the largest thing in memory, larger than the model itself.

The simplest way to store the cache is to give each request one long, contiguous region, as long as the longest
answer it might ever produce. Most answers are much shorter than that, so most of the region stays empty, and the
memory that could have served other requests sits unused. Operating systems met the same problem decades ago with
programs and their memory, and solved it with paging: memory is cut into small pages of equal size, and each
program keeps a table that maps the pages it sees to the pages it really has. A page is given out only when it is
needed, and returned as soon as it is not.

Paged attention applies that idea to the cache. The memory is cut into blocks that each hold the keys and values of
a few tokens. A request holds a small table of the blocks it uses, in order, and the attention kernel follows that
table as it reads. Because a block is taken only when a token needs it, the only waste is the unfilled end of the
last block of each request. Because blocks are counted, two requests that start with the same text can share the
blocks of that text, and a request that asks for several answers to one question stores the question only once.

With memory no longer the limit, the scheduler can keep many requests running together. At every step it decides
which requests advance, how many new tokens each may compute, and which must wait. When memory runs short it pauses
the newest request, frees its blocks and computes them again later, so that older requests always finish. The
result is an engine that serves more people on the same machine, with the same answers, and without asking anyone
to guess in advance how long their answer will be.

Quantized weights follow the same thought. A model whose numbers are stored in four or eight bits instead of
sixteen or thirty-two takes a fraction of the memory, and reading fewer bytes for every token makes each step
faster when the step is bound by memory, as decoding one stream is. The cost is a small change in the numbers the
model computes, which a careful format keeps smaller than the differences between two runs of the same model on
two different machines.
"""
