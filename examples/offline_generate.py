"""The seed's offline example, with `from pagellm` and the embedded default model."""

from pagellm import LLM, SamplingParams

# 1. Initialize PagedAttention engine and control parameters
llm = LLM(
    model="SmolLM2-135M-Instruct",
    gpu_memory_utilization=0.80,
    max_num_batched_tokens=4096,
    block_size=16,
)

# 2. Set sampling parameters and run inference
prompts = ["리눅스 커널의 mmap() 동작 원리를 설명해줘.", "JVM의 G1GC에 대해 알려줘."]
sampling_params = SamplingParams(temperature=0.7, max_tokens=200)

outputs = llm.generate(prompts, sampling_params)

for output in outputs:
    print(f"Prompt: {output.prompt!r}, Generated: {output.outputs[0].text!r}")

# The same engine, greedy, in English, and through the model's chat template.
greedy = SamplingParams(temperature=0, max_tokens=48)
for output in llm.generate(["The capital of France is", "def fibonacci(n):"], greedy, use_tqdm=False):
    print(f"Prompt: {output.prompt!r}, Generated: {output.outputs[0].text!r}")
chat = llm.chat([{"role": "user", "content": "What is paged attention? Answer in one sentence."}], greedy, use_tqdm=False)
print(f"Chat: {chat[0].outputs[0].text!r}")

stats = llm.llm_engine.get_stats()
print(f"KV blocks used after the run: {stats.kv_cache.num_used_blocks}/{stats.kv_cache.num_blocks}")
